"""Bytes for the ``payload`` and ``result`` columns: JSON with numpy arrays, without pickle.

Layout: 4-byte little-endian header length, the JSON header, then the raw bytes of every array in
order. In the JSON, an array is ``{"__nd__": i, "dtype": "<f4", "shape": [...]}`` (``i`` indexes the
arrays). Only plain numeric dtypes are accepted, so decoding never runs code.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

_ALLOWED = {"b", "i", "u", "f"}  # bool, signed, unsigned, float


def encode(obj: Any) -> bytes:
    """Serialise nested dicts/lists/scalars/strings and numpy arrays."""
    arrays: list[np.ndarray] = []

    def walk(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in _ALLOWED:
                raise TypeError(f"cannot encode arrays of dtype {x.dtype}")
            arrays.append(np.ascontiguousarray(x))
            return {"__nd__": len(arrays) - 1, "dtype": x.dtype.str, "shape": list(x.shape)}
        if isinstance(x, dict):
            return {str(k): walk(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [walk(v) for v in x]
        if isinstance(x, np.generic):
            return x.item()
        return x

    header = json.dumps(walk(obj), separators=(",", ":")).encode()
    return b"".join([struct.pack("<I", len(header)), header, *(a.tobytes() for a in arrays)])


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode` (arrays are fresh, writable copies)."""
    (n,) = struct.unpack_from("<I", data, 0)
    header = json.loads(data[4 : 4 + n])
    offset = 4 + n
    specs: list[tuple[int, np.dtype, tuple[int, ...]]] = []

    def collect(x: Any) -> None:
        if isinstance(x, dict):
            if "__nd__" in x:
                dtype = np.dtype(x["dtype"])
                if dtype.kind not in _ALLOWED:
                    raise ValueError(f"refusing dtype {dtype}")
                specs.append((x["__nd__"], dtype, tuple(x["shape"])))
            else:
                for v in x.values():
                    collect(v)
        elif isinstance(x, list):
            for v in x:
                collect(v)

    collect(header)
    arrays: dict[int, np.ndarray] = {}
    for idx, dtype, shape in sorted(specs):
        count = int(np.prod(shape, dtype=np.int64))
        arrays[idx] = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
        offset += count * dtype.itemsize

    def build(x: Any) -> Any:
        if isinstance(x, dict):
            if "__nd__" in x:
                return arrays[x["__nd__"]]
            return {k: build(v) for k, v in x.items()}
        if isinstance(x, list):
            return [build(v) for v in x]
        return x

    return build(header)
