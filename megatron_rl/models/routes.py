"""Routed experts as they travel: one response's `[positions, moe_layers, top_k]` expert ids (uint8 or int16) in a
JSON-able form (base64 bytes, shape, dtype), so that samples carrying them stay plain data in the buffer and in
its checkpoints. Shared by the engine actor (which encodes) and the trainer's batch (which decodes); numpy only."""

from __future__ import annotations

import base64

import numpy as np

ROUTE_DTYPES = ("uint8", "int16")
"""The compact dtypes routes travel in: uint8 up to 256 experts, int16 beyond."""


def encode_routes(rows: np.ndarray) -> dict:
    """`{"data", "shape", "dtype"}` of a `[positions, layers, top_k]` route array (JSON-able)."""
    rows = np.ascontiguousarray(rows)
    if rows.ndim != 3 or rows.dtype.name not in ROUTE_DTYPES:
        raise ValueError(f"routes must be [positions, layers, top_k] of {ROUTE_DTYPES}, got {rows.dtype} {rows.shape}")
    return {
        "data": base64.b64encode(rows.tobytes()).decode("ascii"),
        "shape": list(rows.shape),
        "dtype": rows.dtype.name,
    }


def decode_routes(entry: dict) -> np.ndarray:
    """The `[positions, layers, top_k]` array of an `encode_routes` entry; ValueError naming what is wrong."""
    try:
        dtype, shape = np.dtype(entry["dtype"]), [int(n) for n in entry["shape"]]
        data = base64.b64decode(entry["data"], validate=True)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"routes entry is not {{data, shape, dtype}}: {err}") from None
    if dtype.name not in ROUTE_DTYPES or len(shape) != 3 or len(data) != dtype.itemsize * int(np.prod(shape)):
        raise ValueError(f"routes entry of shape {shape} and dtype {dtype} holds {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape)
