"""The README's install resolves without backtracking: pip's resolver, asked as the README asks it (``pip install
torch==<the README's> -e ".[extra]"``, in a dry run that ignores what is installed, as on a fresh machine), takes the
pinned transformers, huggingface-hub and accelerate at once, keeps torch's CPU build, and pulls no CUDA package."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("transformers", "huggingface-hub", "accelerate", "litgpt")


def _pins() -> dict[str, str]:
    """Each pinned package (``name==version`` in an extra) -> its version, from pyproject.toml."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins: dict[str, str] = {}
    for requirement in (r for requirements in extras.values() for r in requirements):
        name, sep, version = requirement.partition("==")
        if sep:
            assert pins.setdefault(name.lower(), version) == version, f"{name} pinned twice, differently"
    return pins


def _readme_torch() -> str:
    """The torch release the README's set-up names (``pip install torch==X ...``)."""
    found = set(re.findall(r"pip install torch==([\w.+]+)", (ROOT / "README.md").read_text()))
    assert len(found) == 1, f"the README names torch {found or 'without a pin'}: one pinned release expected"
    return found.pop()


def test_every_pip_install_in_the_readme_pins_torch():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"\s*pip install ", line)]
    assert lines and all("torch" not in line or "torch==" in line for line in lines), lines
    assert all(line.lstrip().startswith("pip install torch==") or "-e ." in line for line in lines), lines
    assert set(PINNED) <= set(_pins()), _pins()


def _index_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["examples", "test"])
def test_a_fresh_install_resolves_without_backtracking(tmp_path, extra):
    if not _index_reachable():
        pytest.skip("the package index (pypi.org) cannot be reached")
    torch_release, report = _readme_torch(), tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report",
                           str(report), f"torch=={torch_release}", "-e", f".[{extra}]"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "looking at multiple versions" not in log, re.findall(r".*looking at multiple versions.*", log)
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert {name: resolved.get(name) for name in PINNED} == {name: _pins()[name] for name in PINNED}
    assert resolved["torch"].split("+")[0] == torch_release.split("+")[0]
    if "+cpu" in resolved["torch"]:  # the CPU build (kept here from --find-links): nothing of CUDA comes with it
        assert not [name for name in resolved if name.startswith("nvidia-")]


# ---------------------------------------------------------------- what the tests import, and what the test extra installs

def _extra_requirements(extra: str) -> list[str]:
    """The requirements ``pip install -e ".[extra]"`` asks for, from this checkout's pyproject.toml: the package's
    own, the extra's, and those of the extras it names (``lightning-lowmem[litgpt]``)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted, extras, seen = list(project["dependencies"]), [extra], set()
    while extras:
        name = extras.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in project["optional-dependencies"][name]:
            parsed = Requirement(requirement)
            if parsed.name == project["name"]:
                extras.extend(parsed.extras)
            else:
                wanted.append(requirement)
    return wanted


def _installed_with(requirements: list[str]) -> set[str]:
    """The distributions installing ``requirements`` brings, followed through each installed distribution's own
    requirements (markers evaluated here, with the extras asked for); a distribution not installed here is missing."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found, todo, missing = set(), [(r, "") for r in requirements], []
    while todo:
        text, extra = todo.pop()
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        key = (_normal(requirement.name), tuple(sorted(requirement.extras)))
        if key in found:
            continue
        found.add(key)
        try:
            requires = metadata.distribution(requirement.name).requires or []
        except metadata.PackageNotFoundError:
            missing.append(requirement.name)
            continue
        todo.extend((r, e) for r in requires for e in (requirement.extras or {""}))
    assert not missing, f"not installed here, so their requirements are unknown: {missing}"
    return {name for name, _ in found}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(tree) -> set[tuple[str, bool]]:
    """``(top-level module, guarded)`` for every absolute import in ``tree``: guarded inside a ``try`` that catches
    ``ImportError`` (or ``ModuleNotFoundError``), or named in the file's ``pytest.importorskip``."""
    import ast

    skipped = {node.args[0].value.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", None) == "importorskip" and node.args
               and isinstance(node.args[0], ast.Constant)}
    guarded_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h.type) for h in node.handlers):
            guarded_nodes.update(id(n) for statement in node.body for n in ast.walk(statement))
    found = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for name in names:
            top = name.split(".")[0]
            found.add((top, id(node) in guarded_nodes or top in skipped))
    return found


def _catches_import_error(handler) -> bool:
    import ast

    names = [handler] if not isinstance(handler, ast.Tuple) else handler.elts
    return any(getattr(n, "id", None) in ("ImportError", "ModuleNotFoundError") for n in names)


def _test_sources():
    """Each test file's syntax tree, and those of the scripts its strings hold (the fresh processes it starts)."""
    import ast

    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        yield path, tree
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
                try:
                    yield path, ast.parse(node.value)
                except SyntaxError:
                    continue


def test_every_third_party_import_of_the_tests_is_in_the_test_extra_or_guarded():
    """On a fresh machine ``pip install -e ".[test]"`` must install what the tests import: a third-party module
    the extra does not bring is imported only where a missing one skips (``pytest.importorskip``, or a ``try`` that
    catches ``ImportError``)."""
    from importlib import metadata

    installed = _installed_with(_extra_requirements("test"))
    providers = metadata.packages_distributions()
    local = {"lightning_lowmem", "conftest", "tests"}
    outside = {}
    for path, tree in _test_sources():
        for module, guarded in _imports(tree):
            if guarded or module in local or module in sys.stdlib_module_names:
                continue
            dists = {_normal(d) for d in providers.get(module, [])}
            if not dists & installed:
                outside.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    assert not outside, (f"imported by the tests but not installed by the test extra: {outside}; add the package to "
                         "the test extra in pyproject.toml, or skip without it (pytest.importorskip)")


def test_ci_runs_the_readmes_test_command_in_a_fresh_environment_outside_the_checkout(tmp_path):
    """``.ci/run`` makes a new virtual environment outside the checkout and runs README.md's test command in it, from
    the repository root, then removes it. Here its interpreter is a stand-in that records what runs where instead of
    installing."""
    log, stub = tmp_path / "log", tmp_path / "python3"
    stub.write_text(f"""#!/bin/sh
# a stand-in for `python3 -m venv DIR`: DIR/bin/activate defines pip and python, which record their calls
[ "$1" = "-m" ] && [ "$2" = "venv" ] || exit 3
mkdir -p "$3/bin"
cat > "$3/bin/activate" <<'ACTIVATE'
pip() {{ echo "pip $* | $PWD | $VIRTUAL_ENV" >> {log}; }}
python() {{ echo "python $* | $PWD | $VIRTUAL_ENV" >> {log}; }}
ACTIVATE
echo "VIRTUAL_ENV=$3" >> "$3/bin/activate"
echo "venv $3" >> {log}
""")
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([str(ROOT / ".ci" / "run"), "-k", "x"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    made, pip, pytest_ = log.read_text().splitlines()
    venv = Path(made.removeprefix("venv "))
    assert venv.parent == tmp_path and ROOT not in venv.parents and not venv.exists()  # outside, and removed after
    readme = re.search(r"^# 2\. the test suite\n(.*)$", (ROOT / "README.md").read_text(), re.MULTILINE).group(1)
    install, test = readme.split(" && ")
    assert pip == f"{install} | {ROOT} | {venv}".replace('".[test]"', ".[test]")
    assert pytest_ == f"{test} -k x | {ROOT} | {venv}"
