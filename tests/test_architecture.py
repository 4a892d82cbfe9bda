"""The import rules of docs/architecture.md, read from the source of every module under dynserve/.

Each rule names a part and the parts of ours it may not import; every import statement counts, at module level
or inside a function, under TYPE_CHECKING or not, so a new module cannot break a rule silently.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dynserve"

# The shared language: every part may import it, and it imports only itself.
SHARED = {"dynserve.config", "dynserve.protocol", "dynserve.hashing", "dynserve.errors", "dynserve.framing",
          "dynserve.shutdown"}
PARTS = ["model", "engine", "workers", "kv_transfer", "router", "events", "gateway", "observability", "planner",
         "operator", "cli"]

# part -> the parts of ours it may import besides the shared language and itself
ALLOWED: dict[str, set[str]] = {
    "shared": set(),
    "model": set(),
    "engine": {"model"},
    "kv_transfer": set(),
    "events": set(),
    "router": {"events"},
    "workers": {"model", "engine", "kv_transfer", "events"},
    "gateway": {"model", "router", "events", "workers"},
    "observability": set(),
    "planner": {"events", "observability", "operator"},
    "operator": set(),
    "cli": set(PARTS),
}
# third-party packages a part must never import
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "shared": {"torch", "ray"},
    "model": {"torch", "ray"},
    "engine": {"ray", "fastapi", "starlette", "httptools", "redis", "kopf", "kubernetes"},
    "router": {"torch"},
    "gateway": {"torch"},
    "events": {"torch"},
    "observability": {"torch", "ray"},
    "planner": {"torch"},
    "operator": {"torch", "ray"},
}


def _part_of(module: str) -> str | None:
    """'shared', a part's name, or None for the package root (`dynserve/__init__.py`)."""
    if module in SHARED:
        return "shared"
    pieces = module.split(".")
    if len(pieces) >= 2 and pieces[1] in PARTS:
        return pieces[1]
    return None


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, *, with_names: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved. `with_names`:
    also `module.name` for each name a `from module import name` takes (the name may be a submodule)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            # `from dynserve import engine` imports a part too
            if base == "dynserve" or with_names:
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        part = _part_of(module)
        if part is None:
            continue
        for line, target in _imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            top = target.split(".")[0]
            if top in FORBIDDEN_THIRD_PARTY.get(part, set()):
                problems.append(f"{where}: {part} must not import {top}")
                continue
            if top != "dynserve" or target == "dynserve":
                continue
            target_part = _part_of(target)
            if target_part in (None, part, "shared"):
                continue
            if target_part not in ALLOWED[part]:
                problems.append(f"{where}: {part} may not import {target_part}")
    return problems


def test_every_module_keeps_the_import_rules() -> None:
    assert _violations() == []


def test_the_rules_are_the_ones_the_docs_state() -> None:
    """docs/architecture.md states each rule this test enforces, by the words of its table."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for part, allowed in ALLOWED.items():
        if part in ("shared", "cli"):
            continue
        line = next((row for row in text.splitlines() if row.startswith(f"| `{part}/`")), None)
        assert line is not None, f"docs/architecture.md has no import-rule row for {part}/"
        for other in allowed:
            assert f"`{other}/`" in line, f"the {part}/ row does not name {other}/"


@pytest.mark.parametrize(
    ("source", "part", "expected"),
    [
        ("from dynserve.engine.core import EngineCore", "gateway", "gateway may not import engine"),
        ("import dynserve.workers.channel", "events", "events may not import workers"),
        ("from dynserve import cli", "workers", "workers may not import cli"),
        ("from dynserve.workers import pool", "shared", "shared may not import workers"),
        ("import torch", "model", "model must not import torch"),
    ],
)
def test_a_broken_rule_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, part: str,
                                 expected: str) -> None:
    """The checker itself: a module that breaks a rule is reported (so the test above cannot pass vacuously)."""
    root = tmp_path / "dynserve"
    where = root / ("protocol.py" if part == "shared" else f"{part}/probe.py")
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(source + "\n")
    monkeypatch.setitem(globals(), "PACKAGE", root)
    assert any(expected in problem for problem in _violations())


# ---- no import cycles --------------------------------------------------------------------------------------


def _import_graph(roots: list[Path]) -> dict[str, set[str]]:
    """module -> the modules of `roots` (packages' directories under the repository root) it imports, by
    every import statement; a package stands for its `__init__`, and `from a import b` imports `a.b` when
    that is a module."""
    files = {_module_name(path): path for root in roots for path in sorted(root.rglob("*.py"))}
    return {module: {target for _, target in _imports(path, with_names=True) if target in files}
            for module, path in files.items()}


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import each other, directly or through others (a strongly connected
    component of more than one module, or a module importing itself), sorted."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen: set[str] = set()
        stack = list(graph[start])
        while stack:
            module = stack.pop()
            if module not in seen:
                seen.add(module)
                stack += graph[module]
        reach[start] = seen
    cycles = {frozenset(other for other in reach[module] if module in reach[other])
              for module in graph if module in reach[module]}
    return sorted(sorted(cycle) for cycle in cycles)


def test_no_import_cycles_among_the_packages_modules_or_the_benchmarks() -> None:
    """A module that imports another which imports it back (even inside a function) is one idea split in
    two: the shared piece belongs in a module both import."""
    graph = _import_graph([PACKAGE, PACKAGE.parent / "benchmarks"])
    assert "dynserve.workers.worker" in graph and "benchmarks.planner" in graph  # the walk found both trees
    assert _import_cycles(graph) == []


def test_an_import_cycle_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: cycles through a submodule taken by `from`, an import inside a function, a
    package's `__init__`, a relative import and a module importing itself are each reported."""
    sources = {
        "dynserve/__init__.py": "",
        "dynserve/cli/__init__.py": "",
        "dynserve/cli/main.py": "def main():\n    from dynserve.cli import mocker\n",
        "dynserve/cli/mocker.py": "from dynserve.cli.main import main\n",
        "dynserve/workers/__init__.py": "from .pool import Pool\n",
        "dynserve/workers/pool.py": "from dynserve.workers import channel\n",
        "dynserve/workers/channel.py": "import dynserve.workers\n",
        "dynserve/engine/__init__.py": "",
        "dynserve/engine/core.py": "import dynserve.engine.core\n",
        "dynserve/engine/sequence.py": "from dynserve.engine import core\n",
        "benchmarks/__init__.py": "",
        "benchmarks/planner.py": "from benchmarks.planner_trace import generate\n",
        "benchmarks/planner_trace.py": "def main():\n    from benchmarks.planner import Plan\n",
    }
    for name, source in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "dynserve")
    assert _import_cycles(_import_graph([tmp_path / "dynserve", tmp_path / "benchmarks"])) == [
        ["benchmarks.planner", "benchmarks.planner_trace"],
        ["dynserve.cli.main", "dynserve.cli.mocker"],
        ["dynserve.engine.core"],
        ["dynserve.workers", "dynserve.workers.channel", "dynserve.workers.pool"],
    ]


# ---- third-party imports are declared ----------------------------------------------------------------------


def _distribution_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503's normalized name


def _declared_distributions(pyproject: Path) -> set[str]:
    """Every distribution `[project]` names: its dependencies and each optional group's."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [*project["dependencies"], *(r for group in project["optional-dependencies"].values()
                                                for r in group)]
    return {_distribution_key(re.split(r"[\s\[<>=!~;@]", r, maxsplit=1)[0]) for r in requirements}


def _undeclared_imports(package: Path, declared: set[str], distributions: dict[str, list[str]]) -> list[str]:
    """'path:line imports top (distribution)' for each import of a third-party module whose distribution
    `declared` does not name; `distributions`: top-level module -> the installed distributions with it."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        for line, target in _imports(path):
            top = target.split(".")[0]
            if top in sys.stdlib_module_names or top == "dynserve":
                continue
            providers = distributions.get(top, [])
            if not any(_distribution_key(d) in declared for d in providers):
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {top} "
                                f"({', '.join(providers) or 'not installed'})")
    return problems


def test_pyproject_declares_every_third_party_module_the_package_imports() -> None:
    """Each module dynserve/ imports (at module level or inside a function) is ours, the standard library's,
    or comes from a distribution pyproject.toml names, as a dependency or in an optional group. Read from
    the installed distributions' metadata: nothing is imported."""
    declared = _declared_distributions(PACKAGE.parent / "pyproject.toml")
    assert {"torch", "ray", "kubernetes", "pyyaml", "urllib3"} <= declared
    assert _undeclared_imports(PACKAGE, declared, importlib.metadata.packages_distributions()) == []


def test_an_undeclared_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: an import of an installed but undeclared distribution, or of a module nothing
    installed provides, is reported; the standard library and our own modules are not."""
    root = tmp_path / "dynserve"
    root.mkdir()
    (root / "probe.py").write_text("import json\nfrom . import config\nimport yaml\n"
                                   "def f():\n    import nowhere_to_be_found\n")
    monkeypatch.setitem(globals(), "PACKAGE", root)
    assert _undeclared_imports(root, {"torch"}, {"yaml": ["PyYAML"]}) == [
        "dynserve/probe.py:3 imports yaml (PyYAML)",
        "dynserve/probe.py:5 imports nowhere_to_be_found (not installed)",
    ]

