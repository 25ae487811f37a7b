"""Checkpoint keys -> module names: explicit renames, and a prefix guessed when keys sit one level off.

A key map is a dict of prefix renames (``{"model.": ""}``, first match wins) or a
callable returning the module name, or None to drop the key on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

KeyMap = Mapping[str, str] | Callable[[str], str | None]


def apply_key_map(key: str, key_map: KeyMap | None) -> str | None:
    """The module name for checkpoint key ``key`` (None drops the key).

    Example::

        >>> apply_key_map("model.lm_head.weight", {"model.": ""})
        'lm_head.weight'
        >>> apply_key_map("rotary.inv_freq", lambda key: None if "inv_freq" in key else key) is None
        True
    """
    if key_map is None:
        return key
    if callable(key_map):
        return key_map(key)
    for old, new in key_map.items():  # prefix renames, first match wins
        if key.startswith(old):
            return new + key[len(old):]
    return key


def guess_prefix(module_keys: set[str], ckpt_keys: list[str]) -> tuple[KeyMap | None, str]:
    """A prefix rename when the checkpoint's keys sit one level above or below the module's, and a note saying so.

    A Lightning ``.ckpt`` of a LightningModule holding ``self.model`` has keys
    ``model.transformer...`` where the bare model wants ``transformer...``, and
    the other way round when a plain model file is loaded into the LightningModule.

    Example::

        >>> guess_prefix({"lm_head.weight"}, ["model.lm_head.weight"])
        ({'model.': ''}, "stripped 'model.' from checkpoint keys")
    """
    def hits(key_map: KeyMap) -> int:
        return sum(apply_key_map(k, key_map) in module_keys for k in ckpt_keys)

    best: tuple[int, KeyMap | None, str] = (sum(k in module_keys for k in ckpt_keys), None, "")
    if best[0] == len(ckpt_keys):
        return None, ""
    ckpt_heads = {k.split(".", 1)[0] + "." for k in ckpt_keys if "." in k}
    module_heads = {k.split(".", 1)[0] + "." for k in module_keys if "." in k}
    candidates = [({head: ""}, f"stripped {head!r} from checkpoint keys") for head in sorted(ckpt_heads)]
    candidates += [({"": head}, f"added {head!r} to checkpoint keys") for head in sorted(module_heads)]
    for key_map, note in candidates:
        n = hits(key_map)
        if n > best[0]:
            best = (n, key_map, note)
    return best[1], best[2]


def names_fit(module_keys: set[str], ckpt_keys: list[str]) -> bool:
    """Whether a checkpoint names its tensors as the module does (a prefix guessed at most): at least half its keys
    are the module's names. Otherwise its names are another library's, for a conversion to map.

    Example::

        >>> names_fit({"transformer.wte.weight", "lm_head.weight"}, ["model.transformer.wte.weight"])
        True
        >>> names_fit({"transformer.wte.weight"}, ["gpt_neox.embed_in.weight", "embed_out.weight"])
        False
    """
    key_map, _ = guess_prefix(module_keys, ckpt_keys)
    hits = sum(apply_key_map(key, key_map) in module_keys for key in ckpt_keys)
    return bool(ckpt_keys) and 2 * hits >= len(ckpt_keys)
