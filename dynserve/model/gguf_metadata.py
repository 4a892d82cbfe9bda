"""GGUF headers: every key/value pair of a GGUF file, and where each tensor lies, read without touching the
tensors' data.

Parsed here directly: `gguf.GGUFReader` builds a numpy view per array element and needs seconds for a
49k-token vocabulary (the tokenizer and the model loader both read a file's header). Little-endian GGUF
versions 2 and 3.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGUF_MAGIC, GGUFValueType

from dynserve.errors import TokenizerError

__all__ = ["GGUFHeader", "GGUFTensorInfo", "read_gguf_header", "read_gguf_metadata"]

_GGUF_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_LENGTH = struct.Struct("<Q")  # a string's length in bytes, in front of it


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor's entry: `dims` in GGUF order (fastest-varying first), its ggml type, and where its data
    starts, in bytes from the start of the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every key/value pair of a little-endian GGUF (v2 or v3) file; tensors are not touched."""
    return read_gguf_header(path, with_tensors=False).metadata


def read_gguf_header(path: str | os.PathLike[str], with_tensors: bool = True) -> GGUFHeader:
    """The key/value pairs and (`with_tensors`) the tensors' entries of a GGUF file. TokenizerError when it
    is not a GGUF file this reads (callers that load weights say so in their own error)."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            magic, version, num_tensors, num_kvs = struct.unpack_from("<IIQQ", buffer, 0)
            if magic != GGUF_MAGIC:
                raise TokenizerError(f"{path} is not a GGUF file (bad magic {magic:#x})")
            if version not in (2, 3):
                raise TokenizerError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
            metadata: dict[str, Any] = {}
            offset = struct.calcsize("<IIQQ")
            for _ in range(num_kvs):
                key, offset = _read_gguf_string(buffer, offset)
                (value_type,), offset = struct.unpack_from("<I", buffer, offset), offset + 4
                metadata[key], offset = _read_gguf_value(buffer, offset, value_type)
            if not with_tensors:
                return GGUFHeader(metadata, [])
            entries = []
            for _ in range(num_tensors):
                name, offset = _read_gguf_string(buffer, offset)
                (num_dims,) = struct.unpack_from("<I", buffer, offset)
                dims = struct.unpack_from(f"<{num_dims}Q", buffer, offset + 4)
                offset += 4 + 8 * num_dims
                ggml_type, data_offset = struct.unpack_from("<IQ", buffer, offset)
                offset += 12
                entries.append((name, dims, ggml_type, data_offset))
            alignment = int(metadata.get("general.alignment", 32))
            data_start = -(-offset // alignment) * alignment
            tensors = [GGUFTensorInfo(name, tuple(dims), ggml_type, data_start + data_offset)
                       for name, dims, ggml_type, data_offset in entries]
            return GGUFHeader(metadata, tensors)
    except (OSError, ValueError, struct.error) as exc:
        raise TokenizerError(f"cannot read GGUF metadata from {path}: {exc}") from exc


def _read_gguf_string(buffer: mmap.mmap, offset: int) -> tuple[str, int]:
    (num_bytes,) = struct.unpack_from("<Q", buffer, offset)
    start = offset + 8
    return buffer[start : start + num_bytes].decode("utf-8"), start + num_bytes


def _read_gguf_value(buffer: mmap.mmap, offset: int, value_type: int) -> tuple[Any, int]:
    if value_type == GGUFValueType.STRING:
        return _read_gguf_string(buffer, offset)
    if value_type in _GGUF_SCALAR_FORMATS:
        value_format = _GGUF_SCALAR_FORMATS[value_type]
        return struct.unpack_from(value_format, buffer, offset)[0], offset + struct.calcsize(value_format)
    if value_type != GGUFValueType.ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type} at byte {offset}")
    element_type, num_elements = struct.unpack_from("<IQ", buffer, offset)
    offset += 12
    if element_type in _GGUF_SCALAR_FORMATS:
        dtype = np.dtype(_GGUF_SCALAR_FORMATS[element_type])
        values = np.frombuffer(buffer, dtype=dtype, count=num_elements, offset=offset).tolist()
        return values, offset + dtype.itemsize * num_elements
    if element_type == GGUFValueType.STRING:  # a vocabulary: 262k tokens for Gemma, so one tight loop
        strings, unpack_length = [], _LENGTH.unpack_from
        for _ in range(num_elements):
            (num_bytes,) = unpack_length(buffer, offset)
            offset += 8
            strings.append(buffer[offset : offset + num_bytes].decode("utf-8"))
            offset += num_bytes
        return strings, offset
    elements = []
    for _ in range(num_elements):
        element, offset = _read_gguf_value(buffer, offset, element_type)
        elements.append(element)
    return elements, offset
