"""The engine's C++ CPU kernels, compiled on first use with torch's extension builder.

- `paged_decode` (csrc/paged_decode_cpu.cpp): decode attention over the paged cache, fp32 or bf16. In plain
  torch the keys and values must first be gathered into contiguous tensors (a copy) before attention reads
  them again; this kernel reads each cached key and value once, straight through the block table.
- `paged_attention` (csrc/attention_bf16_cpu.cpp): a step's bf16 attention, prefill chunks and decode rows
  alike, with one arithmetic for every row (bf16 `paged_decode` runs the same code), so a row's result does
  not depend on how its sequence was split into steps or what the prefix cache held (AVX512-BF16).
- the bf16 step's ops (csrc/cpu_ops.cpp, used through `kernels.cpu_ops`): `linear` for a decode step's few
  rows (AVX512-BF16, streaming each weight once), `rms_norm`, `add_rms_norm`, `silu_mul`, `rope_`.

They need a C++ compiler and `ninja`; when either is missing, or the build fails, `load()` returns None and
the torch paths serve instead (logged once).

The build is cached once per machine: under `$XDG_CACHE_HOME/dynserve/kernels/<key>` (`~/.cache` by
default), where the key is a hash of the sources' bytes, the compiler flags, the compiler's own version
line, torch's and Python's versions and the CPU architecture. Any process, from any checkout or virtualenv,
whose key matches loads the built library directly, without running the compiler or ninja; a changed source,
flag, compiler or torch builds anew into a new key. A build completes into its directory before a marker
file is written, so a half-built library is never loaded; concurrent first builds wait on torch's lock in
that directory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["load"]

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_cpu.cpp", "attention_bf16_cpu.cpp", "cpu_ops.cpp")]


_NAME = "dynserve_cpu_native"
_COMPLETE = "complete"  # written once the library in a key's directory is whole


def _flags() -> list[str]:
    # fast math vectorizes the sums and, through glibc's vector math (only with finite math), the softmax's
    # exp: keeping NaN semantics (-fno-finite-math-only) made decode attention scalar (docs/benchmarks.md).
    # The price: a NaN activation may come out of the bf16 conversions as another value instead of NaN.
    flags = ["-O3", "-ffast-math", "-fopenmp"]  # at::parallel_for is OpenMP inside the header
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=x86-64-v3")  # AVX2 + FMA
    return flags


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")  # the compiler torch's builder runs
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return f"{compiler}: {exc}"
    return f"{compiler}: {done.stdout.splitlines()[0] if done.stdout else done.returncode}"


def cache_key(flags: list[str], compiler: str) -> str:
    """What the built library depends on, hashed: the sources, the flags, the compiler, torch, Python, CPU."""
    import torch

    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for part in (" ".join(flags), compiler, torch.__version__, sys.version, platform.machine()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:24]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynserve" / "kernels"


def _import_built(directory: Path) -> ModuleType:
    """The extension module built in `directory` (torch must be imported first: it links against it)."""
    import torch  # noqa: F401  (loads libtorch, which the library needs)

    path = directory / f"{_NAME}.so"
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def load() -> Any | None:
    """The compiled module (`paged_decode(query, kv_cache, layer, block_tables, seq_lens, scale)` and the
    ops of csrc/cpu_ops.cpp), or None when it cannot be built here."""
    try:
        flags = _flags()
        directory = cache_dir() / cache_key(flags, _compiler_version())
        if (directory / _COMPLETE).exists():
            return _import_built(directory)
        from torch.utils import cpp_extension

        # the build runs `ninja` from PATH; a venv's ninja is found even when the venv is not activated
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        directory.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=_NAME,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
        (directory / _COMPLETE).touch()
        return module
    except Exception as exc:  # a missing compiler or ninja surfaces as one of many exception types
        logger.warning("C++ CPU kernels unavailable, using the torch paths: %s", exc)
        return None
