"""`pip install .` as a new user runs it: a fresh virtualenv, the CPU torch first (as `make setup` does), then
dynserve with only the dependencies pyproject.toml declares, gives a `dynctl serve` that starts and answers.

This is the one test that reaches the package registry; it installs without byte-compiling (the slow part of
an install that proves nothing here), with this virtualenv's pip (the same version), and serves mocker workers.
Torch is not unpacked again: the fresh virtualenv sees this one's torch and what torch needs (and nothing
else) through a `.pth` file, so pip finds torch installed, as it would after `make setup`'s first step, and
installs everything else itself.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from conftest import needs

from dynserve.model.resolve import default_model_path

REPO = Path(__file__).resolve().parent.parent


def _pip(venv: Path, *args: str) -> None:
    """pip install into `venv`, with this virtualenv's pip (the version `venv` would bundle: same Python)."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                           "--quiet", "--no-compile", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
@needs('install')
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding torch (CPU) and `pip install .` of this checkout, from a copy of its sources (so
    the build leaves nothing in the work tree)."""
    root = tmp_path_factory.mktemp("install")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info",
                                                                 "__pycache__", ".pytest_cache", ".hypothesis",
                                                                 "results"))
    venv = root / "venv"
    # without pip of its own (ensurepip unpacking pip and setuptools into it is 7 s here): pip runs from
    # here, the packages it installs go into `venv`, and `venv` holds no setuptools dynserve could lean on
    # without declaring it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    _share_torch(venv, root / "torch-only")
    _pip(venv, str(source))
    return venv


def _with_requirements(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution `name` and every distribution it requires, transitively (extras left out)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [Requirement(name)]
    while todo:
        requirement = todo.pop()
        key = canonicalize_name(requirement.name)
        if key in found or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        found[key] = distribution = importlib.metadata.distribution(requirement.name)
        todo += [Requirement(text) for text in distribution.requires or []]
    return list(found.values())


def _share_torch(venv: Path, shared: Path) -> None:
    """Make this interpreter's torch, and only what torch needs, importable and installed in `venv`: their
    top-level packages and metadata linked into `shared`, which a `.pth` file puts on `venv`'s path."""
    shared.mkdir()
    for distribution in _with_requirements("torch"):
        tops = {Path(str(file)).parts[0] for file in distribution.files or []}
        for top in tops - {"..", "bin", "__pycache__"}:
            target = Path(str(distribution.locate_file(top)))
            if target.exists() and not (shared / top).exists():
                (shared / top).symlink_to(target)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "shared-torch.pth").write_text(f"{shared}\n")


def test_pip_install_gives_a_dynctl_serve_that_serves(installed: Path, dynctl_serve: Any) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    # the model package is data installed --no-deps by `make setup`, not a dependency: point at its file
    command = [str(installed / "bin" / "dynctl"), "serve", "--port", "0", "--mocker", "cpu", "--workers", "1",
               "--model", str(default_model_path())]
    with dynctl_serve(command, 180, env, cwd=installed) as served:
        models = httpx.get(f"http://127.0.0.1:{served.port}/v1/models", timeout=30).json()
        body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        answer = httpx.post(f"http://127.0.0.1:{served.port}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    assert served.code == 0
    # the installed package is the one that served, not this checkout
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import dynserve; print(dynserve.__file__)"],
                           capture_output=True, text=True, check=True, cwd=installed).stdout
    assert str(installed) in where
