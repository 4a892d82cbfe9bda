"""The import rules of docs/architecture.md, read from the source of every module under dynserve/.

Each rule names a part and the parts of ours it may not import; every import statement counts, at module level
or inside a function, under TYPE_CHECKING or not, so a new module cannot break a rule silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dynserve"

# The shared language: every part may import it, and it imports only itself.
SHARED = {"dynserve.config", "dynserve.protocol", "dynserve.hashing", "dynserve.errors", "dynserve.framing"}
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


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved."""
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
            if base == "dynserve":
                found += [(node.lineno, f"dynserve.{alias.name}") for alias in node.names]
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
