"""The package's layout, read from its source: imports follow the data flow, modules and functions stay short.

Folders, in the order each may import the ones before it: the ground (the top-level modules, ``memory/``
and ``transfer/``), then formats, plan, quantize, placement, runtime, request, sources, ranks, routes, engine, saving, lightning, litgpt,
transformers, diffusers, cli.
Every import statement counts, those inside functions included: so the read path (formats to engine) never imports the
write path (saving). ``__main__`` (``python -m lightning_lowmem``) is an entry
point, like the package root: it may import any folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lightning_lowmem"
SOURCE = Path(__file__).resolve().parents[1] / PACKAGE
ORDER = ["ground", "formats", "plan", "quantize", "placement", "runtime", "request", "sources", "ranks", "routes", "engine",
         "saving", "lightning", "litgpt", "transformers", "diffusers", "cli"]
ENTRY_POINTS = {PACKAGE, f"{PACKAGE}.__main__"}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    modules = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def imports_in(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every package module that ``source`` (the text of ``module``) imports, at any depth.

    ``from a.b import c`` imports ``a.b.c`` when that is a module, else ``a.b``; relative imports are resolved.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base))
    return [(line, name) for line, name in found if name == PACKAGE or name.startswith(PACKAGE + ".")]


def imports_of(module: str) -> list[tuple[int, str]]:
    path = MODULES[module]
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def folder(module: str) -> str:
    """The module's folder in ``ORDER`` ("ground" for top-level modules and ``memory/``), or "root" for the package
    and ``__main__``."""
    parts = module.split(".")
    if module in ENTRY_POINTS:
        return "root"
    return parts[1] if parts[1] in ORDER else "ground"


def layering_violations(module: str, imported: list[tuple[int, str]]) -> list[str]:
    bad = []
    source = folder(module)
    for line, name in imported:
        target = folder(name)
        if target == "root":
            bad.append(f"line {line}: {module} imports the package root {name}")
        elif source != "root" and ORDER.index(target) > ORDER.index(source):
            bad.append(f"line {line}: {module} ({source}) imports {name} ({target})")
    return bad


def find_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Cycles met by a depth-first walk of ``graph`` (each as ``[a, b, ..., a]``); empty when it has none."""
    on_path: list[str] = []
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        on_path.append(node)
        for target in graph.get(node, []):
            if target in on_path:
                cycles.append(on_path[on_path.index(target):] + [target])
            elif target not in done:
                visit(target)
        on_path.pop()
        done.add(node)

    for node in graph:
        if node not in done:
            visit(node)
    return cycles


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of the function's body after its docstring, to its last line."""
    body = function.body
    has_docstring = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                     and isinstance(body[0].value.value, str))
    start = body[0].end_lineno + 1 if has_docstring else body[0].lineno
    return function.end_lineno - start + 1


def test_no_import_cycle():
    graph = {module: sorted({name for _, name in imports_of(module) if name in MODULES and name != module})
             for module in MODULES}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_each_folder_imports_only_the_ground_and_the_folders_before_it():
    bad = [f"{MODULES[module]}: {message}" for module in MODULES
           for message in layering_violations(module, imports_of(module))]
    assert not bad, "imports against the data flow:\n" + "\n".join(bad)


def test_no_module_is_longer_than_400_lines():
    lengths = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    bad = [f"{MODULES[m]} ({m}): {n} lines" for m, n in lengths.items() if n > MAX_MODULE_LINES]
    assert not bad, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(bad)


def test_no_function_is_longer_than_50_lines_of_code():
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > MAX_FUNCTION_LINES:
                bad.append(f"{path}:{node.lineno}: {module}.{node.name}: {code_lines(node)} lines of code")
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines of code:\n" + "\n".join(bad)


def test_the_checks_find_what_they_look_for():
    """Each check, given code written to break it, finds the break: a check that finds nothing is no check."""
    assert {"lightning_lowmem", "lightning_lowmem.engine.load", "lightning_lowmem.memory.units"} <= set(MODULES)
    assert all(folder(m) in ORDER for m in MODULES if m not in ENTRY_POINTS)
    assert [folder(m) for m in ("lightning_lowmem.memory.units", "lightning_lowmem.dtypes",
                                "lightning_lowmem.engine.load", PACKAGE, "lightning_lowmem.__main__",
                                "lightning_lowmem.cli.commands")] == ["ground", "ground", "engine", "root", "root", "cli"]

    source = ("import torch\n"
              "from . import records\n"
              "from ..plan import keys\n"
              "def read():\n"
              "    from lightning_lowmem.engine import load_checkpoint\n"
              "    import lightning_lowmem\n")
    imported = imports_in(source, "lightning_lowmem.formats.fake")
    assert imported == [(2, "lightning_lowmem.formats.records"), (3, "lightning_lowmem.plan.keys"),
                        (5, "lightning_lowmem.engine"), (6, "lightning_lowmem")]
    assert layering_violations("lightning_lowmem.formats.fake", imported) == [
        "line 3: lightning_lowmem.formats.fake (formats) imports lightning_lowmem.plan.keys (plan)",
        "line 5: lightning_lowmem.formats.fake (formats) imports lightning_lowmem.engine (engine)",
        "line 6: lightning_lowmem.formats.fake imports the package root lightning_lowmem"]
    assert layering_violations("lightning_lowmem.dtypes", [(1, "lightning_lowmem.memory.units")]) == []
    assert imports_in("from . import bnb", "lightning_lowmem.quantize", is_package=True) == [
        (1, "lightning_lowmem.quantize.bnb")]

    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []

    tree = ast.parse("def f():\n    '''doc'''\n" + "    x = 1\n" * 51 + "def g():\n    '''doc'''\n    x = 1\n")
    assert {node.name: code_lines(node) for node in tree.body} == {"f": 51, "g": 1}
