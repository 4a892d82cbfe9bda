"""Large CPU tensors backed by transparent huge pages where Linux offers them.

The KV cache and the packed weights are read all over on every step; in 4 KiB pages their reads miss the
TLB at every page. Linux backs a mapping with 2 MiB pages when asked (`madvise(MADV_HUGEPAGE)`, honoured
when `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`), so `empty` asks for the
2 MiB-aligned interior of each new tensor before anything touches it. Elsewhere (another OS, a GPU, a
refusal) it is `torch.empty`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

__all__ = ["empty"]

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MIN_BYTES = 4 * _HUGE_PAGE  # smaller tensors gain little


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.empty(shape)`, on CPU with its memory advised to huge pages (best effort)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    madvise = _madvise()
    num_bytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or madvise is None or num_bytes < _MIN_BYTES:
        return tensor
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + num_bytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # a refusal leaves ordinary pages: nothing to undo
    return tensor
