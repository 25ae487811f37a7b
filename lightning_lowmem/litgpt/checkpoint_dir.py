"""A litgpt ``GPT`` from a checkpoint path: which weights, which config, which tokenizer; built on meta and loaded.

Which weights a path stands for is the engine's resolver's answer (``lightning_lowmem.sources.resolve``), the
same for every face: a file is itself; a directory's one weight set is read; several sets are compared on
the model this directory's config builds (the same tensors: the one litgpt takes as it is, ``lit_model.pth``;
different ones: an error saying how to pick, ``prefer=`` / ``--weights``). The conversion of the weights'
names into litgpt's (HF, GGUF) is registered with the resolver too (:mod:`.conversions`).

The config: the one given, else a GGUF file's metadata (:mod:`.gguf`), else the directory's
``model_config.yaml``, its name (a litgpt model name, as ``litgpt convert_to_litgpt`` reads it), or its HF
``config.json`` (:mod:`.hf_config`). The tokenizer: the directory's ``tokenizer.json`` / ``tokenizer.model``,
or a GGUF file's vocabulary.

The model is built on the meta device, RoPE tables included, so nothing the size of the whole context is
allocated, then loaded by :func:`~lightning_lowmem.engine.run_load` (streamed and quantized one tensor at a
time); Fabric only sets the loaded module up for its precision. Caches are sized per request by
:func:`~lightning_lowmem.setup_kv_cache`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from lightning_lowmem.dtypes import precision_flag
from lightning_lowmem.engine import LoadOptions, LoadReport, run_load
from lightning_lowmem.request.defaults import compute_dtype, execution_device
from lightning_lowmem.sources.entries import entry_for
from lightning_lowmem.sources.weight_sets import Chosen, candidate_sets, choose_set, one_set_why
from lightning_lowmem.errors import CheckpointFormatError, CheckpointNotFoundError
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.discovery import GGUF_MAGIC
from lightning_lowmem.litgpt.gguf import GGUFSource, litgpt_config, read_gguf_source
from lightning_lowmem.litgpt.architecture import LITGPT
from lightning_lowmem.litgpt.config_check import check_class_names, check_config_fits
from lightning_lowmem.litgpt.hf_config import config_from_hf_json
from lightning_lowmem.litgpt.prompt_style import has_chat_template_style
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.litgpt.rope import generation_rope_dtype, pin_generation_rope_dtype
from lightning_lowmem.memory.heap import release_free_heap
from lightning_lowmem.meta import fabric_unwrapped, init_empty
from lightning_lowmem.quiet import quietly

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass
class LitgptCheckpoint:
    """What a checkpoint path holds for litgpt: the weights chosen and why, the config, the tokenizer if any.

    Attributes:
        directory: the directory of the weights (where tokenizer and prompt-style files are looked for).
        weights: the file (or ``*.index.json``) the resolver chose.
        config: the litgpt ``Config`` (None only from :meth:`find` with ``require_config=False``).
        tokenizer: a litgpt ``Tokenizer``, or None (prompts are then token ids).
        gguf: what a GGUF file says beyond its tensors (its transformers config), None otherwise.
        why: why these weights (logged; shown by ``inspect``).
        config_source: where the config came from (without one: why none was found).
        entry: the entry of a torch file holding the weights, as asked (``entry=``), or None.
    """

    directory: Path
    weights: Path
    config: Any
    tokenizer: Any | None
    gguf: GGUFSource | None = None
    why: str = ""
    config_source: str = ""
    entry: str | None = None

    @classmethod
    @quietly
    def find(cls, path: str | Path, config: Any | None = None, prefer: str | None = None, *,
             require_config: bool = True, tokenizer: bool = True, verify: bool = False,
             entry: str | None = None) -> LitgptCheckpoint:
        """Inspect ``path``, a directory or a file (reads headers, and a sample of each weight set's bytes when a
        directory holds several; every byte with ``verify``, the ``verify_weight_sets`` option).

        With ``tokenizer=False`` no tokenizer is built (``estimate`` and ``inspect`` read headers only). ``entry``: the
        entry of a torch file holding the weights (the ``entry`` option; see ``sources/entries.py``).

        Raises:
            CheckpointNotFoundError: ``path`` does not exist or holds no weights.
            AmbiguousCheckpointError: a directory holds several different weight sets and ``prefer`` picks none.
            ValueError: no config given, and none found (see :func:`find_config`), with ``require_config``.
        """
        config = config_of(config)
        path = Path(path).expanduser()
        directory = path if path.is_dir() else path.parent
        if not path.exists():
            raise CheckpointNotFoundError(f"Checkpoint {str(path)!r} does not exist. Check the path.")
        weights, why = _chosen_weights(path, config, prefer, verify, entry)
        if _is_gguf(weights):
            return cls._from_gguf(directory, weights, config, why, tokenizer)
        origin = "given"
        if config is None:
            config, origin = _directory_config(directory, require_config)
        if config is not None:
            _check_fits(config, weights, entry)
        return cls(directory, weights, config, _tokenizer(directory) if tokenizer else None, why=why,
                   config_source=origin, entry=entry)

    def with_config(self, config: Any) -> LitgptCheckpoint:
        """The same weights with another litgpt config, checked against their headers first.

        Raises:
            CheckpointMismatchError: the config's counts or widths do not fit the weights.
        """
        config = config_of(config)
        _check_fits(config, self.weights)
        return dataclasses.replace(self, config=config, config_source="given")

    @property
    def chosen(self) -> Chosen:
        """The weights as the resolver chose them, for a load or a plan (not chosen again)."""
        return Chosen(self.weights, self.why, self.entry)

    @classmethod
    def _from_gguf(cls, directory: Path, weights: Path, config: Any | None, why: str,
                   tokenizer: bool = True) -> LitgptCheckpoint:
        """A GGUF file: the config (unless given) and the tokenizer from the file itself."""
        with Checkpoint.open(weights) as ckpt:
            source = read_gguf_source(ckpt, tokenizer=tokenizer)
        origin = "given" if config is not None else "the GGUF file's metadata"
        config = config or litgpt_config(source.hf_config, source.names)
        return cls(directory, weights, config, source.tokenizer, source, why=why, config_source=origin)


def _chosen_weights(path: Path, config: Any | None, prefer: str | None, verify: bool = False,
                    entry: str | None = None) -> tuple[Path, str]:
    """The weights the resolver chooses for ``path``; several sets in a directory are compared on the model the
    directory's config builds (on their own names without one)."""
    if not path.is_dir():
        return path, f"{path}: the file given"
    sets = candidate_sets(path, prefer)
    if len(sets) == 1:
        return sets[0].path, one_set_why(path, sets[0], prefer)
    config = config or _directory_config(path, required=False)[0]
    if config is not None:
        _check_fits(config, sets[0].path, entry)  # before a model is built from it to compare the sets
    with contextlib.ExitStack() as stack:
        choice = choose_set(path, build_meta_gpt(config) if config is not None else None, prefer, stack, verify,
                            entry)
    return choice.path, choice.why


def _check_fits(config: Any, weights: Path, entry: str | None = None) -> None:
    """The config's counts and widths against the weights' headers (the entry a load of the model reads), before any
    weight is read (:func:`~lightning_lowmem.litgpt.config_check.check_config_fits`)."""
    with entry_for(lambda: build_meta_gpt(config), entry), Checkpoint.open(weights) as ckpt:
        check_config_fits(config, ckpt.records, ckpt.description)


def build_meta_gpt(config: Any) -> nn.Module:
    """litgpt's ``GPT(config)`` with every parameter and buffer on meta (no RoPE computed)."""
    GPT = import_litgpt(needed_by="Building litgpt's GPT").GPT

    with init_empty(include_buffers=True):
        return GPT(config)


def load_litgpt(checkpoint: LitgptCheckpoint, options: LoadOptions) -> tuple[nn.Module, LoadReport]:
    """Build litgpt's ``GPT`` on meta and load the chosen weights into it (the engine's ``run_load``).

    Args:
        checkpoint: what :meth:`LitgptCheckpoint.find` found.
        options: the load options, dtype and device decided (``generation.generation_options``); a tensor the
            checkpoint lacks is an error, never a randomly initialized "adapter".

    Returns:
        ``(model, report)``: the model set up by Fabric for its precision (``fabric.setup_module``), in eval mode,
        and the loader's report.
    """
    import lightning as L

    from lightning_lowmem.lightning.strategy import LowMemStrategy

    device, dtype = execution_device(options), compute_dtype(options)  # bf16 -> fp16 on a device without bf16
    if device is None or dtype is None:
        raise ValueError("load_litgpt needs the device and dtype decided (generation_options decides them).")
    fabric = L.Fabric(accelerator=device.type, devices=1, strategy=LowMemStrategy(device=device),
                      precision=precision_flag(dtype))
    with fabric.init_module():  # the precision's default dtype for what GPT builds; build_meta_gpt: all on meta
        model = build_meta_gpt(checkpoint.config)
    report = run_load(model, checkpoint.chosen, options)
    model = fabric.setup_module(model).eval()
    held = options.scheme or next(iter(sorted(set(report.quantized.values()))), None)  # on load, or as stored
    rope_dtype = generation_rope_dtype(dtype, held)
    if rope_dtype != dtype:  # as litgpt's generate leaves them
        LITGPT.reset_buffers(model, device)
    pin_generation_rope_dtype(fabric_unwrapped(model), rope_dtype)  # chat's loop computes RoPE as generate's does
    return model, report


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def _directory_config(directory: Path, required: bool) -> tuple[Any | None, str]:
    """:func:`find_config` of ``directory``; with ``required`` False, ``(None, why not)`` where it finds none."""
    try:
        return find_config(directory)
    except ValueError as e:  # none found; a config file that cannot be read is an error either way
        if required:
            raise
        return None, str(e)


def find_config(directory: Path) -> tuple[Any, str]:
    """The litgpt ``Config`` of a checkpoint directory, and where it came from: ``model_config.yaml``, else the
    directory's name (a litgpt model name), else the HF ``config.json`` (its ``_name_or_path``, then its shapes).

    Raises:
        CheckpointNotFoundError: ``directory`` is not a directory.
        ValueError: none of these gives a config; the message lists what was tried.
        CheckpointFormatError: ``model_config.yaml`` cannot be read as a litgpt config (:func:`config_from_file`), or
            ``config.json`` is not a JSON object.
    """
    Config = import_litgpt(needed_by="Finding a checkpoint's litgpt config").Config

    if not directory.is_dir():
        raise CheckpointNotFoundError(f"Checkpoint directory {str(directory)!r} does not exist (or is a file). "
                                      "Check the path.")
    if (directory / "model_config.yaml").is_file():
        return config_from_file(directory / "model_config.yaml"), "model_config.yaml"
    with contextlib.suppress(ValueError):
        return Config.from_name(directory.name), f"the directory's name {directory.name!r}"
    tried = f"no model_config.yaml in {str(directory)!r}, and its name {directory.name!r} is no litgpt model name"
    if not (directory / "config.json").is_file():
        raise ValueError(f"No litgpt config for {str(directory)!r}: {tried}, and there is no config.json. Pass "
                         "config=NAME, a litgpt model name such as 'pythia-1b' (--config NAME), or name the directory after "
                         "the model (e.g. checkpoints/EleutherAI/pythia-1b).")
    try:
        return config_from_hf_json(directory / "config.json")
    except ValueError as e:
        raise ValueError(f"No litgpt config for {str(directory)!r}: {tried}. {e}") from e


def config_of(value: Any) -> Any | None:
    """The litgpt ``Config`` that ``value`` stands for: a ``Config`` itself, a litgpt model name (``"pythia-1b"``),
    or the path of a ``model_config.yaml``; None stays None. The command line's ``--config`` reads the same.

    Raises:
        TypeError: ``value`` is none of these types.
        ValueError: a string that is neither an existing file nor a litgpt model name.
        CheckpointFormatError: the file is not a litgpt config (:func:`config_from_file`).

    Example::

        >>> config_of("pythia-14m").n_layer, config_of(None)
        (6, None)
    """
    if value is None:
        return None
    Config = import_litgpt(needed_by="Reading a litgpt config").Config

    if isinstance(value, Config):
        return value
    if not isinstance(value, (str, Path)):
        raise TypeError(f"config={value!r} ({type(value).__name__}) is not a litgpt config. Pass a litgpt model name "
                        "(config='pythia-1b'), a litgpt.Config (litgpt.Config.from_name('pythia-1b')), or the path "
                        "of a model_config.yaml.")
    if Path(value).expanduser().is_file():
        return config_from_file(Path(value).expanduser())
    try:
        return Config.from_name(str(value))
    except ValueError as e:
        raise ValueError(f"config={str(value)!r} is neither a model_config.yaml file nor a litgpt model name. Pass a "
                         "name such as 'pythia-1b' or 'Llama-3.2-1B', or the path of a model_config.yaml.") from e


def config_from_file(path: Path) -> Any:
    """litgpt's ``Config.from_file(path)``, a file that is not a litgpt config being a typed error naming it.

    Raises:
        CheckpointFormatError: ``path`` is not YAML (a syntax error, a ``!!python/...`` tag, which ``yaml.safe_load``
            refuses), not a mapping, or not ``Config``'s fields.
        UnsafeCheckpointError: it names an MLP or norm class litgpt's configs do not use
            (:func:`~lightning_lowmem.litgpt.config_check.check_class_names`).
    """
    Config = import_litgpt(needed_by="Reading a model_config.yaml").Config

    try:
        config = Config.from_file(path)
    except Exception as e:  # noqa: BLE001  (yaml's, litgpt's and Config's errors: any of them means a bad file)
        raise CheckpointFormatError(
            f"{path} is not a litgpt config ({type(e).__name__}: {' '.join(str(e).split())[:300]}). It must be a YAML "
            "mapping of litgpt Config's fields, as litgpt "
            "writes it (litgpt.utils.save_config); fix or remove it, or pass the config another way (--config NAME, "
            "or config=litgpt.Config.from_name(NAME)).") from e
    check_class_names(config, path)
    return config


def has_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds a tokenizer litgpt reads (``tokenizer.json`` or ``tokenizer.model``)."""
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _tokenizer(directory: Path) -> Any | None:
    if not has_tokenizer(directory):
        return None
    if has_chat_template_style(directory):  # a GGUF file's tokenizer and chat template, written out by `quantize`
        from lightning_lowmem.litgpt.gguf_tokenizer import read_tokenizer

        return read_tokenizer(directory)
    Tokenizer = import_litgpt("litgpt.tokenizer", needed_by="Reading a checkpoint's tokenizer").Tokenizer

    tokenizer = Tokenizer(directory)
    release_free_heap()  # what reading it freed (its JSON): 12 MiB of a 49k-token BPE tokenizer's 28, as GGUF's
    return tokenizer
