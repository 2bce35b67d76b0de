"""safetensors files read and written with numpy only (the format is a JSON header and
raw little-endian bytes; nothing is unpickled)."""

from __future__ import annotations

import json
import struct

import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(data: bytes, *, copy: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file's bytes (bfloat16 ones as float32); with ``copy=False``
    read-only views of ``data`` where the dtype allows."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, stop = entry["data_offsets"]
        chunk = body[start:stop]
        if entry["dtype"] == "BF16":
            values = (np.frombuffer(chunk, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.frombuffer(chunk, dtype=np.dtype(_DTYPES[entry["dtype"]]).newbyteorder("<"))
        values = values.reshape(entry["shape"])
        tensors[name] = values.copy() if copy else values
    return tensors


_NAMES = {np.dtype(dtype).newbyteorder("<"): name for name, dtype in _DTYPES.items()}


def write_safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors file's bytes holding ``tensors`` (little-endian, in the given order)."""
    header, blobs, offset = {}, [], 0
    for name, values in tensors.items():
        values = np.ascontiguousarray(values, dtype=np.dtype(values.dtype).newbyteorder("<"))
        blob = values.tobytes()
        header[name] = {
            "dtype": _NAMES[values.dtype],
            "shape": list(values.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs)
