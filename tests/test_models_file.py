"""`dynctl serve --models-file models.yaml`: the models a file lists, the first the default, as `--model` and
`--served-model-name` would give them; a file that cannot serve is refused by name before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynserve.cli.main import _build_parser
from dynserve.cli.options import settings_from
from dynserve.config import ModelsFileEntry, Settings, read_models_file
from dynserve.errors import InvalidRequestError

DYNCTL = str(Path(sys.executable).parent / "dynctl")
MODELS_YAML = """\
models:
  - model: ~/models/SmolLM2-135M-Instruct.Q4_1.gguf
    served_model_names: [small, smol]
  - model: {qwen}
    served_model_names: [q]
  - model: ~/models/gemma-3-270m-q4_k_m.gguf
"""


def _serve(*flags: str) -> Settings:
    return settings_from(_build_parser().parse_args(["serve", *flags]))


# ---- the loader ----------------------------------------------------------------------------------------------

def test_the_loader_reads_each_model_and_its_names_in_order() -> None:
    assert read_models_file(MODELS_YAML.format(qwen="/srv/Qwen3-0.6B")) == [
        ModelsFileEntry(model="~/models/SmolLM2-135M-Instruct.Q4_1.gguf", served_model_names=["small", "smol"]),
        ModelsFileEntry(model="/srv/Qwen3-0.6B", served_model_names=["q"]),
        ModelsFileEntry(model="~/models/gemma-3-270m-q4_k_m.gguf")]


@pytest.mark.parametrize(("text", "message"), [
    ("- model: a.gguf\n", "give a mapping with a 'models' list"),
    ("models:\n  model: a.gguf\n", "models: not a list"),
    ("models: []\n", "models: no models listed"),
    ("models: [{model: a.gguf, alias: x}]\n", "models.0.alias: unknown key"),
    ("models: [{model: a.gguf}]\nworkers: 2\n", "workers: unknown key"),
    ("models: [{served_model_names: [x]}]\n", "models.0.model: missing"),
    ("models: [{model: a.gguf, served_model_names: [x=a]}]\n", "models.0.served_model_names.0"),
    ("models: [{model: a.gguf\n", "not YAML"),
])
def test_a_bad_file_is_a_value_error_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_models_file(text)


# ---- dynctl serve's flags -------------------------------------------------------------------------------------

def test_a_models_file_gives_what_the_model_flags_give(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    qwen = tmp_path / "Qwen3-0.6B"  # a directory: its id is its whole name, dots and all
    qwen.mkdir()
    path = tmp_path / "models.yaml"
    path.write_text(MODELS_YAML.format(qwen=qwen))
    from_file = _serve("--models-file", str(path), "--workers", "2")
    from_flags = _serve("--model", "~/models/SmolLM2-135M-Instruct.Q4_1.gguf", "--model", str(qwen), "--model",
                        "~/models/gemma-3-270m-q4_k_m.gguf", "--served-model-name", "small",
                        "--served-model-name", "smol", "--served-model-name", "q=Qwen3-0.6B", "--workers", "2")
    for field in ("model", "extra_models", "served_model_names", "workers"):
        assert getattr(from_file, field) == getattr(from_flags, field), field
    # its env twin does the same
    monkeypatch.setenv("DYN_MODELS_FILE", str(path))
    assert _serve().extra_models == [str(qwen), "~/models/gemma-3-270m-q4_k_m.gguf"]


def test_a_models_file_beside_the_model_flags_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models: [{model: a.gguf}]\n")
    with pytest.raises(InvalidRequestError, match="give it, or --model and --served-model-name"):
        _serve("--models-file", str(path), "--model", "b.gguf")
    monkeypatch.setenv("DYN_SERVED_MODEL_NAMES", '["x"]')
    with pytest.raises(InvalidRequestError, match="not both"):
        _serve("--models-file", str(path))
    monkeypatch.delenv("DYN_SERVED_MODEL_NAMES")
    with pytest.raises(InvalidRequestError, match=r"--models-file: cannot read .*absent\.yaml"):
        _serve("--models-file", str(tmp_path / "absent.yaml"))


def test_serve_refuses_a_bad_models_file_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - model: a.gguf\n    served_as: [x]\n")
    done = subprocess.run([DYNCTL, "serve", "--models-file", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--models-file {path}: models.0.served_as: unknown key" in done.stderr
    assert "Ray" not in done.stderr and "dynserve:" not in done.stderr  # nothing started
    listed = " ".join(subprocess.run([DYNCTL, "serve", "--help"], capture_output=True, text=True,
                                     check=True).stdout.split())
    assert "--models-file" in listed and "env: DYN_MODELS_FILE" in listed
