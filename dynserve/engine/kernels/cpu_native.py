"""The engine's C++ CPU kernels, compiled on first use with torch's extension builder.

- `paged_decode` (csrc/paged_decode_cpu.cpp): decode attention over the paged cache, fp32 or bf16. In plain
  torch the keys and values must first be gathered into contiguous tensors (a copy) before attention reads
  them again; this kernel reads each cached key and value once, straight through the block table.
- the bf16 step's ops (csrc/cpu_ops.cpp, used through `kernels.cpu_ops`): `linear` for a decode step's few
  rows (AVX512-BF16, streaming each weight once), `rms_norm`, `add_rms_norm`, `silu_mul`, `rope_`.

They need a C++ compiler and `ninja`; when either is missing, or the build fails, `load()` returns None and
the torch paths serve instead (logged once). The build is cached under torch's extensions directory, so
only the first process pays for it (about a minute on 2 cores).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any

__all__ = ["load"]

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode_cpu.cpp", "cpu_ops.cpp")]


@functools.cache
def load() -> Any | None:
    """The compiled module (`paged_decode(query, kv_cache, layer, block_tables, seq_lens, scale)` and the
    ops of csrc/cpu_ops.cpp), or None when it cannot be built here."""
    try:
        from torch.utils import cpp_extension

        # the build runs `ninja` from PATH; a venv's ninja is found even when the venv is not activated
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

        # fast math vectorizes the sums and, through glibc's vector math (only with finite math), the
        # softmax's exp: keeping NaN semantics (-fno-finite-math-only) made decode attention scalar and a
        # batch-16 step about 25% slower (ITL p50 51 -> 67 ms in vs_vllm). The price: a NaN activation may
        # come out of the bf16 conversions as another value instead of NaN.
        flags = ["-O3", "-ffast-math", "-fopenmp"]  # at::parallel_for is OpenMP inside the header
        if platform.machine() in ("x86_64", "AMD64"):
            flags.append("-march=x86-64-v3")  # AVX2 + FMA
        return cpp_extension.load(
            name="dynserve_cpu_native",
            sources=[str(source) for source in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja surfaces as one of many exception types
        logger.warning("C++ CPU kernels unavailable, using the torch paths: %s", exc)
        return None
