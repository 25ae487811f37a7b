"""The faces and ``LoadOptions`` stay one: every face takes ``options=``, ``dtype``, ``quantize`` (``device`` where it
has one) and any other field by name; its other keywords are its own, documented; the docs name no keyword a face
does not take.

Nothing here loads a weight: a bad value of each field is refused where the face merges its options, before any
file is opened, which shows that the keyword reached ``LoadOptions``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_lowmem import Combine, LoadOptions, LowMemError, estimate_memory, generate, load_checkpoint
from lightning_lowmem.engine import placement_plan
from lightning_lowmem.request.options import option_names
from lightning_lowmem.litgpt.generation import load_for_generation

ROOT = Path(__file__).resolve().parents[1]
FIELDS = option_names()
COMMON = {"options", "dtype", "quantize"}  # every face names these; any other field comes through **load_options


def _lightning(name: str) -> Callable[..., Any]:
    from lightning_lowmem import lightning  # noqa: F401  (imports Lightning)

    module = {"LowMemStrategy": "strategy", "LowMemFSDPStrategy": "fsdp", "LowMemCallback": "callback"}[name]
    return getattr(__import__(f"lightning_lowmem.lightning.{module}", fromlist=[name]), name)


def _lightning_own(base: str) -> set[str]:
    """The arguments of the Lightning class a strategy extends: its own, passed through as Lightning takes them."""
    import lightning.fabric.strategies as strategies

    return set(inspect.signature(getattr(strategies, base)).parameters)


@dataclass
class Face:
    """One face: how to call it with only keywords added, its own keywords, and the fields it refuses.

    Attributes:
        get: the face (a function, or a class: its constructor).
        call: ``call(face, **keywords)`` calls it with whatever else it needs (a module, a path that does not exist).
        own: its keywords that are not load options (``options`` aside).
        named: the load options it names in its signature (``options``, ``dtype``, ``quantize``, maybe ``device``).
        refuses: fields it cannot honour, each refused with a ``ValueError`` naming the face and the field.
    """

    get: Callable[[], Callable[..., Any]]
    call: Callable[..., Any]
    own: Callable[[], set[str]]
    named: set[str] = field(default_factory=lambda: set(COMMON))
    refuses: set[str] = field(default_factory=set)


def _module() -> nn.Module:
    return nn.Linear(2, 2)


FACES = {
    "load_checkpoint": Face(lambda: load_checkpoint, lambda f, **kw: f(_module(), "missing.safetensors", **kw),
                            lambda: {"module", "checkpoint"}, COMMON | {"device"}),
    "placement_plan": Face(lambda: placement_plan, lambda f, **kw: f(_module(), None, **kw),
                           lambda: {"module", "checkpoint", "kv_cache_bytes", "activation_bytes", "read_bandwidth"},
                           COMMON | {"max_memory"}),  # max_memory: its third positional argument
    "estimate_memory": Face(lambda: estimate_memory, lambda f, **kw: f("pythia-14m", **kw),
                            lambda: {"source", "max_seq_length", "prompt_length", "config", "runtime", "read_bandwidth"}),
    "generate": Face(lambda: generate, lambda f, **kw: f(_module(), [1, 2], **kw),
                     lambda: {"checkpoint", "prompt", "precision", "max_new_tokens", "temperature", "top_k", "top_p",
                              "num_samples", "config", "tokenizer", "seed", "compile", "sys_prompt", "prompt_style",
                              "on_load", "on_sample"},
                     COMMON | {"device"}),
    "load_for_generation": Face(lambda: load_for_generation, lambda f, **kw: f("missing", **kw),
                                lambda: {"checkpoint_dir", "precision", "config"}, COMMON | {"device"}),
    "LowMemStrategy": Face(lambda: _lightning("LowMemStrategy"), lambda f, **kw: f(**kw),
                           lambda: _lightning_own("SingleDeviceStrategy") - {"device"} | {"init_added"},
                           COMMON | {"device"}),  # device: Lightning's own argument, the strategy's device
    "LowMemFSDPStrategy": Face(lambda: _lightning("LowMemFSDPStrategy"), lambda f, **kw: f(**kw),
                               lambda: _lightning_own("ModelParallelStrategy") | {"init_added"},
                               refuses={"max_memory", "device"}),
    "LowMemCallback": Face(lambda: _lightning("LowMemCallback"), lambda f, **kw: f("missing.pth", **kw),
                           lambda: {"checkpoint", "save_frozen"}, refuses={"device"}),
}

BAD = {"device": "nodevice", "dtype": torch.int8, "quantize": 5, "skip_quantize": [5], "treat_as_linear": [5],
       "strict": "yes", "key_map": 5,
       "transform": 5, "combine": 5, "max_memory": {}, "disk_offload": "yes", "context": 0, "batch_size": 0,
       "progress": "yes", "mmap": "yes", "prefer": 5, "entry": 5, "verify_weight_sets": "yes"}
"""A value of each field that ``LoadOptions`` refuses, with an error naming the field."""

GOOD = {"device": "cpu", "dtype": torch.float16, "quantize": "bnb.int8", "skip_quantize": "lm_head",
        "treat_as_linear": torch.nn.Linear, "strict": False,
        "key_map": {"model.": ""}, "transform": lambda name, t: t,
        "combine": Combine({"w": ("a", "b")}, lambda name, parts: torch.cat(list(parts.values()))),
        "max_memory": {"cpu": "1GiB"}, "disk_offload": True, "context": 8, "batch_size": 2, "progress": False,
        "mmap": True, "prefer": "safetensors", "entry": "model", "verify_weight_sets": True}
"""A value of each field that ``LoadOptions`` takes (``disk_offload`` with ``max_memory``)."""


def _given(name: str, value: Any) -> dict[str, Any]:
    return {name: value, **({"max_memory": GOOD["max_memory"]} if name == "disk_offload" else {})}


def test_every_field_has_a_bad_and_a_good_value():
    assert set(BAD) == set(FIELDS) == set(GOOD), "a LoadOptions field without a value here: add one to BAD and GOOD"


@pytest.mark.parametrize("name", FACES)
def test_a_face_names_only_its_own_keywords_and_takes_every_field(name):
    face = FACES[name]
    function = face.get()
    parameters = inspect.signature(function).parameters
    variadic = [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert [p.name for p in variadic] == ["load_options"], f"{name} takes no **load_options: any field by name"
    keywords = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    named = keywords & (set(FIELDS) | {"options"})
    assert named == face.named, f"{name} names the load options {sorted(named)}, not {sorted(face.named)}"
    own = keywords - named
    assert own == face.own(), (f"{name}'s own keywords are {sorted(own)}; a load option belongs in LoadOptions (and "
                               "reaches the face through **load_options), a new keyword of its own in the table here")
    doc = " ".join((inspect.getdoc(function) or "").split())
    undocumented = sorted(n for n in own | named if not re.search(rf"\b{n}\b", doc))
    assert not undocumented, f"{name}'s docstring does not say what {undocumented} do"
    assert "any other :class:`~lightning_lowmem.LoadOptions` field as a keyword" in doc, \
        f"{name}'s docstring does not point to LoadOptions' attributes for the other fields"


@pytest.mark.parametrize("name", FACES)
@pytest.mark.parametrize("option", FIELDS)
def test_every_field_reaches_load_options_through_every_face(name, option):
    """A bad value of each field is refused by LoadOptions' own check, naming the field: the face passed it on."""
    face = FACES[name]
    with pytest.raises((TypeError, ValueError, LowMemError), match=rf"\b{option}\b") as error:
        face.call(face.get(), **{option: BAD[option]})
    assert "unknown keyword" not in str(error.value) and "unexpected keyword" not in str(error.value)


@pytest.mark.parametrize(("name", "option"), [(n, o) for n, face in FACES.items() for o in sorted(face.refuses)])
def test_a_field_a_face_cannot_honour_is_refused_by_name(name, option):
    face = FACES[name]
    with pytest.raises(ValueError, match=rf"{name}.*\b{option}\b"):
        face.call(face.get(), **{option: GOOD[option]})
    with pytest.raises(ValueError, match=rf"{name}.*\b{option}\b"):  # from the options too
        face.call(face.get(), options=LoadOptions(**{option: GOOD[option]}))


@pytest.mark.parametrize("name", ["LowMemStrategy", "LowMemFSDPStrategy", "LowMemCallback"])
def test_each_field_a_lightning_face_takes_lands_in_its_options(name):
    face = FACES[name]
    taken = [o for o in FIELDS if o not in face.refuses | {"device"} and not (o == "disk_offload" and "max_memory"
                                                                            in face.refuses)]
    for option in taken:
        built = face.call(face.get(), **_given(option, GOOD[option]))
        assert getattr(built.options, option) == getattr(LoadOptions(**_given(option, GOOD[option])), option), option


@pytest.mark.parametrize("name", FACES)
def test_an_unknown_keyword_names_the_face_and_a_close_match(name):
    face = FACES[name]
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unknown keyword argument 'quantise' "
                                        r"\(did you mean 'quantize'\?\)\. It takes .*verify_weight_sets"):
        face.call(face.get(), quantise="bnb.nf4")
    own = sorted(face.own() - {"checkpoint", "module", "source", "prompt", "checkpoint_dir"})
    if own:  # a typo of the face's own keyword is suggested too
        typo = own[0][:-1] + own[0][-1] * 2
        with pytest.raises(TypeError, match=rf"did you mean '{own[0]}'\?"):
            face.call(face.get(), **{typo: None})


# ---------------------------------------------------------------- bad values: the documented types

NAN, INF = float("nan"), float("inf")
V, T = ValueError, TypeError

FIELD_VALUES = {  # more bad values of the LoadOptions fields, each with the type docs/errors.md documents
    "max_memory": [({"gpu": "1GiB"}, V), ({"disk": "1GiB"}, V), ({"meta": 1}, V), ({-1: "1GiB"}, V),
                   ({"cuda:x": 1}, V), ({0: "1GiB", "cuda": "1GiB"}, V), ({"cpu": "-1GiB"}, V), ({"cpu": -1}, V),
                   ({"cpu": "1e400GiB"}, V), ({"cpu": "nan"}, V), ({"cpu": "1 gigabyte"}, V), ({"cpu": 10**30}, V),
                   ({"cpu": None}, T), ({"cpu": 1.5}, T), ({"cpu": True}, T), ({True: "1GiB"}, T), ({None: 1}, T),
                   ("cpu=1GiB", T), (["cpu"], T)],
    "device": [("gpu", V), (1.5, V), ("cuda:x", V)],
    "dtype": [("bf16", T), (torch.int8, T)],
    "context": [(-1, V), (1.5, T), (True, T)],
    "batch_size": [(0, V), (1.5, T), (None, T)],
}


def _field_values() -> list[tuple[str, Any, type]]:
    return [(name, value, kind) for name, values in FIELD_VALUES.items() for value, kind in values]


@pytest.mark.parametrize(("option", "value", "kind"), _field_values(), ids=repr)
def test_a_bad_field_value_is_the_documented_type_naming_the_field(option, value, kind):
    with pytest.raises(kind, match=rf"\b{option}\b"):
        LoadOptions(**{option: value})


@pytest.mark.parametrize("name", FACES)
def test_a_budget_for_no_device_is_a_value_error_naming_max_memory(name):
    """``max_memory={"gpu": ...}``: torch's raw RuntimeError before; every face now, the same ValueError."""
    face = FACES[name]
    with pytest.raises(ValueError, match=r"\bmax_memory\b") as error:
        face.call(face.get(), max_memory={"gpu": "1GiB"})
    assert "'gpu'" in str(error.value) or "max_memory" in face.refuses


@pytest.fixture(scope="module")
def small_gpt():
    from litgpt import GPT, Config

    torch.manual_seed(0)
    return GPT(Config(n_layer=1, n_embd=16, n_head=2, block_size=32, vocab_size=64, padded_vocab_size=64,
                      rotary_percentage=1.0, intermediate_size=32)).eval()


OWN_VALUES = {  # the faces' own keywords: (face, keyword) -> [(bad value, documented type)]
    ("generate", "max_new_tokens"): [(0, V), (-1, V), (1.5, T), (True, T), ("5", T), (None, T), (NAN, T)],
    ("generate", "num_samples"): [(0, V), (1.5, T), (True, T), (None, T)],
    ("generate", "temperature"): [(-1, V), (NAN, V), (INF, V), ("1", T), (None, T), (True, T)],
    ("generate", "top_k"): [(0, V), (-1, V), (1.5, T), ("1", T), (True, T), (INF, T)],
    ("generate", "top_p"): [(-0.1, V), (1.5, V), (NAN, V), ("1", T), (None, T), (True, T)],
    ("generate", "seed"): [(1.5, T), ("1", T), (True, T), (INF, T), (10**30, V)],
    ("generate", "compile"): [("x", T), (1, T), (None, T)],
    ("generate", "sys_prompt"): [(5, T), (["a"], T)],
    ("generate", "prompt_style"): [(5, T), (1.5, T), (["alpaca"], T), ("no-such-style", V)],
    ("generate", "tokenizer"): [(5, T), ("x", T)],
    ("generate", "precision"): [("fp8", V), (5, T), ({}, T)],
    ("setup_kv_cache", "batch_size"): [(0, V), (1.5, T), (True, T), (None, T)],
    ("setup_kv_cache", "max_seq_length"): [(0, V), (NAN, T), (1.5, T), (True, T)],
    ("setup_kv_cache", "device"): [("gpu", V), ("cuda:x", V), (1.5, V)],
    ("setup_kv_cache", "dtype"): [("bf16", T), (torch.int8, T)],
    ("setup_kv_cache", "rope_dtype"): [("bf16", T), (torch.int8, T), (5, T)],
    ("placement_plan", "kv_cache_bytes"): [(-1, V), (1.5, T), ("1GiB", T), (True, T)],
    ("placement_plan", "activation_bytes"): [(-1, V), (1.5, T), (True, T)],
    ("placement_plan", "read_bandwidth"): [(0, V), (-1, V), (NAN, V), (INF, V), ("2GB/s", T), (True, T)],
    ("LowMemCallback", "save_frozen"): [("yes", T), (None, T), (1, T)],
    ("LowMemStrategy", "init_added"): [("yes", T), (None, T), (1, T)],
}


def _own_call(face: str, small_gpt: nn.Module) -> Callable[..., Any]:
    from lightning_lowmem import setup_kv_cache

    return {"generate": lambda **kw: generate(small_gpt, [1, 2], **{"max_new_tokens": 2, **kw}),
            "setup_kv_cache": lambda **kw: setup_kv_cache(small_gpt, **{"batch_size": 1, "max_seq_length": 8, **kw}),
            "placement_plan": lambda **kw: placement_plan(_module(), None, {"cpu": "1GiB"}, **kw),
            "LowMemCallback": lambda **kw: _lightning("LowMemCallback")("missing.pth", **kw),
            "LowMemStrategy": lambda **kw: _lightning("LowMemStrategy")(**kw)}[face]


@pytest.mark.parametrize(("face", "keyword", "value", "kind"),
                         [(f, k, v, t) for (f, k), values in OWN_VALUES.items() for v, t in values], ids=repr)
def test_a_bad_value_of_a_faces_own_keyword_is_the_documented_type_naming_it(small_gpt, face, keyword, value, kind):
    """Refused before anything is read or generated: never torch's or litgpt's raw error from deep inside."""
    with pytest.raises(kind, match=rf"\b{keyword}\b"):
        _own_call(face, small_gpt)(**{keyword: value})


# ---------------------------------------------------------------- the docs

DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("examples/*.py")])
CALL = re.compile(r"(?:\b(\w+)\.)?\b(" + "|".join([*FACES, "LoadOptions"]) + r")\(")
OPEN, CLOSE = "([{", ")]}"


def _keywords(text: str, start: int) -> list[str] | None:
    """The keyword names at the top level of the call whose ``(`` is at ``start`` (None: it does not close)."""
    depth, quote, names = 0, "", []
    for i in range(start, min(len(text), start + 2000)):
        c = text[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'" and depth and text[i - 1] in " ,([{=:":
            quote = c
        elif c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
            if depth == 0:
                return names
        elif depth == 1 and (m := re.match(r"(?<![\w.=!<>])(\w+)\s*=(?!=)", text[i:])) and \
                not re.match(r"\w", text[i - 1]):
            names.append(m.group(1))
    return None


def _accepted(name: str) -> set[str]:
    if name == "LoadOptions":
        return set(FIELDS)
    parameters = inspect.signature(FACES[name].get()).parameters
    own = {n for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
    return own | set(FIELDS) if any(p.kind is p.VAR_KEYWORD for p in parameters.values()) else own


def doc_drift(text: str) -> list[str]:
    """``face(... name=...)`` in ``text`` where the face (or ``LoadOptions``) takes no ``name``."""
    bad = []
    for match in CALL.finditer(text):
        owner, name = match.groups()
        if owner not in (None, "llm", "lightning_lowmem"):  # model.generate(, LLM.generate(: not ours
            continue
        for keyword in _keywords(text, match.end() - 1) or []:
            if keyword not in _accepted(name):
                line = text.count("\n", 0, match.start()) + 1
                bad.append(f"line {line}: {name}(... {keyword}=...): {name} takes no {keyword!r}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_no_keyword_a_face_does_not_take(path):
    bad = doc_drift(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


OTHER_LIBRARIES = {"assign", "ckpt_path", "devices", "dynamic", "mode", "strategy", "quantization_config",
                   "torch_dtype", "subfolder", "safe_serialization"}
"""Keywords of torch, Lightning, litgpt and transformers the docs name in prose (``load_state_dict(assign=True)``,
``strategy=``, ``from_pretrained(quantization_config=...)``)."""


def _public_keywords() -> set[str]:
    """Every parameter of the package's public functions, classes and their methods, and LoadOptions' fields."""
    import lightning_lowmem

    names = set(FIELDS)
    for name in lightning_lowmem.__all__:
        obj = getattr(lightning_lowmem, name)
        methods = [m for _, m in inspect.getmembers(obj, inspect.isfunction)] if inspect.isclass(obj) else []
        for function in [obj, *methods] if callable(obj) else methods:
            try:
                names |= set(inspect.signature(function).parameters)
            except (TypeError, ValueError):  # a builtin without a signature
                continue
    return names


def prose_drift(text: str, known: set[str]) -> list[str]:
    """Keywords the docs name in backticks (`` `quantize=` ``, `` `mmap=True` ``) that nothing takes; environment
    variables (upper case) aside."""
    found = {m.group(1) for m in re.finditer(r"`(\w+)=(?!=)", text)}
    return sorted(n for n in found - known - OTHER_LIBRARIES if not n.isupper())


def test_the_docs_name_in_prose_no_keyword_nothing_takes():
    known = _public_keywords()
    bad = {str(path.relative_to(ROOT)): drift for path in DOCS if path.suffix == ".md"
           if (drift := prose_drift(path.read_text(), known))}
    assert not bad, f"keywords named in the docs that no face nor LoadOptions takes: {bad}"


def test_the_docs_table_of_load_options_is_loadoptions_fields():
    text = (ROOT / "docs" / "loading.md").read_text()
    table = text[text.index("| field | what it does | default |"):]
    table = table[:table.index("\n\n")]
    rows = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert rows == list(FIELDS), "docs/loading.md's table of LoadOptions fields differs from LoadOptions"


def test_the_drift_checks_find_what_they_look_for():
    """Each check, given text or a face written to break it, finds the break."""
    assert doc_drift("load_checkpoint(model, path, dtype=torch.bfloat16, mmap=True)") == []
    assert doc_drift('llm.generate(ckpt, "a=b (c)", max_new_tokens=5, top_k=1, quantise="bnb.nf4")') == [
        "line 1: generate(... quantise=...): generate takes no 'quantise'"]
    assert doc_drift("LoadOptions(dtype=x,\n  colour=dict(red=1))") == [
        "line 1: LoadOptions(... colour=...): LoadOptions takes no 'colour'"]
    assert doc_drift("model.generate(idx, max_tokens=5)  `LowMemCallback(path, device_map=x)`") == [
        "line 1: LowMemCallback(... device_map=...): LowMemCallback takes no 'device_map'"]
    assert _keywords("f(a, b == c, d=dict(e=1), g=[h(i=2)])", 1) == ["d", "g"]
    assert prose_drift("takes `quantize=`, `quantise=`, `mmap=True`, `OMP_NUM_THREADS=1`, `a==b`", set(FIELDS)) == [
        "quantise"]

    def drifted(module, checkpoint, *, options=None, dtype=None, quantize=None, skip_quantize=None, **load_options):
        """Args: module, checkpoint, options, dtype, quantize, skip_quantize; any other
        :class:`~lightning_lowmem.LoadOptions` field as a keyword."""  # and drops skip_quantize
        return LoadOptions.merge(options, drifted, dtype=dtype, quantize=quantize, **load_options)

    def old(module, checkpoint, *, options=None, dtype=None, quantize=None, strict=None, colour=None):
        """Args: module, checkpoint, options, dtype, quantize, strict."""
        return LoadOptions.merge(options, dtype=dtype, quantize=quantize, strict=strict)

    FACES["drifted"] = Face(lambda: drifted, lambda f, **kw: f(None, None, **kw), lambda: {"module", "checkpoint"})
    FACES["old"] = Face(lambda: old, lambda f, **kw: f(None, None, **kw), lambda: {"module", "checkpoint"})
    try:
        with pytest.raises(AssertionError, match="names the load options"):  # a field named beside the three
            test_a_face_names_only_its_own_keywords_and_takes_every_field("drifted")
        with pytest.raises(AssertionError, match="takes no \\*\\*load_options"):
            test_a_face_names_only_its_own_keywords_and_takes_every_field("old")
        with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):  # taken, then dropped
            test_every_field_reaches_load_options_through_every_face("drifted", "skip_quantize")
        test_every_field_reaches_load_options_through_every_face("drifted", "mmap")
        with pytest.raises(AssertionError, match="unexpected keyword"):  # not taken at all
            test_every_field_reaches_load_options_through_every_face("old", "mmap")
        with pytest.raises(AssertionError, match="Regex pattern did not match"):  # Python's error: no valid names
            test_an_unknown_keyword_names_the_face_and_a_close_match("old")
    finally:
        del FACES["drifted"], FACES["old"]
