"""What travels with a sample for MoE rollout-training consistency, in a JSON-able form (base64 bytes, shape,
dtype), so that samples carrying it stay plain data in the buffer and in its checkpoints:

- routed experts: one response's `[positions, moe_layers, top_k]` expert ids (uint8 or int16);
- kept sets: the token ids the engine's top-k / top-p sampler kept at each response position, `[tokens, width]`
  int32 padded with `KEPT_PAD`; a row of only `KEPT_PAD` is a position whose set the engine could not identify
  (more tokens tied inside it than it was asked to report), which the trainer recomputes from its own logits;
- a teacher's top k: at each response position the k token ids the teacher ranks highest and their logprobs,
  `[tokens, k]` int32 and float32 (on-policy distillation with a top-k loss).

Shared by the engine actor (which encodes) and the trainer's batch (which decodes); numpy only.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping

import numpy as np

ROUTE_DTYPES = ("uint8", "int16")
"""The compact dtypes routes travel in: uint8 up to 256 experts, int16 beyond."""
KEPT_DTYPES = ("int32",)
"""Kept sets travel as int32 token ids (vocabularies exceed int16)."""
KEPT_PAD = -1
"""Fills a kept-set row beyond its tokens; a row of only this is a set the engine did not identify."""
TOP_PAD_LOGPROB = -1e30
"""A teacher top-k entry the engine did not return (a position with fewer candidates): weight 0 in the loss."""
"""Fills a kept-set row beyond its tokens; a row of only this is a set the engine did not identify."""


def _encode(rows: np.ndarray, ndim: int, dtypes: tuple[str, ...], what: str) -> dict:
    rows = np.ascontiguousarray(rows)
    if rows.ndim != ndim or rows.dtype.name not in dtypes:
        raise ValueError(f"{what} must be of {dtypes}, got {rows.dtype} {rows.shape}")
    return {
        "data": base64.b64encode(rows.tobytes()).decode("ascii"),
        "shape": list(rows.shape),
        "dtype": rows.dtype.name,
    }


def _decode(entry: dict, ndim: int, dtypes: tuple[str, ...], what: str) -> np.ndarray:
    try:
        dtype, shape = np.dtype(entry["dtype"]), [int(n) for n in entry["shape"]]
        data = base64.b64decode(entry["data"], validate=True)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{what} entry is not {{data, shape, dtype}}: {err}") from None
    if dtype.name not in dtypes or len(shape) != ndim or len(data) != dtype.itemsize * int(np.prod(shape)):
        raise ValueError(f"{what} entry of shape {shape} and dtype {dtype} holds {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def encode_routes(rows: np.ndarray) -> dict:
    """`{"data", "shape", "dtype"}` of a `[positions, layers, top_k]` route array (JSON-able)."""
    return _encode(rows, 3, ROUTE_DTYPES, "routes [positions, layers, top_k]")


def compact_routes(rows: np.ndarray) -> np.ndarray:
    """Expert ids `[positions, layers, top_k]` of any integer dtype (vLLM's own routed-experts output) in the
    compact dtype they travel in: uint8 below 256 experts' ids, else int16; ValueError for ids beyond int16."""
    rows = np.asarray(rows)
    if rows.ndim != 3 or rows.dtype.kind not in "iu":
        raise ValueError(f"routes must be [positions, layers, top_k] integers, got {rows.dtype} {rows.shape}")
    top = int(rows.max()) if rows.size else 0
    if rows.size and int(rows.min()) < 0:
        raise ValueError(f"routes hold a negative expert id ({int(rows.min())})")
    for dtype in ROUTE_DTYPES:
        if top <= np.iinfo(dtype).max:
            return rows.astype(dtype)
    raise ValueError(f"expert id {top} does not fit {ROUTE_DTYPES[-1]}")


def decode_routes(entry: dict) -> np.ndarray:
    """The `[positions, layers, top_k]` array of an `encode_routes` entry; ValueError naming what is wrong."""
    return _decode(entry, 3, ROUTE_DTYPES, "routes")


def encode_kept_sets(rows: np.ndarray) -> dict:
    """`{"data", "shape", "dtype"}` of a `[tokens, width]` int32 kept-set array (JSON-able)."""
    return _encode(rows, 2, KEPT_DTYPES, "kept sets [tokens, width]")


def decode_kept_sets(entry: dict) -> np.ndarray:
    """The `[tokens, width]` int32 array of an `encode_kept_sets` entry; ValueError naming what is wrong."""
    return _decode(entry, 2, KEPT_DTYPES, "kept sets")


def kept_set_row(logprobs: Mapping[int, float], asked: int) -> np.ndarray:
    """One position's kept set `[asked - 1]` int32 from the engine's top-`asked` processed logprobs there
    (token id -> logprob, a float or, as in vLLM's entries, an object with `.logprob`; -inf outside the kept set;
    the sampled token may be one more entry).

    The set is the tokens with a finite logprob. When `asked` or more are finite, the set may hold more than
    the engine reported (ties at the top-k threshold keep them all), so the row is all `KEPT_PAD`: unknown.
    """
    if asked < 2:
        raise ValueError(f"a kept set needs at least 2 logprobs asked per position (top_k + 1), got {asked}")
    kept = sorted(token for token, value in logprobs.items() if math.isfinite(getattr(value, "logprob", value)))
    row = np.full(asked - 1, KEPT_PAD, dtype=np.int32)
    if 0 < len(kept) < asked:
        row[: len(kept)] = kept
    return row


def teacher_top_row(entry: Mapping[int, object] | None, k: int) -> tuple[list[int], list[float]]:
    """The k highest-ranked (token id, logprob) of one vLLM logprobs entry (token id -> Logprob with `rank`; the
    scored token is in it too, at its own rank), best first; missing ones padded with id 0 and `TOP_PAD_LOGPROB`."""
    ranked = sorted(
        ((int(getattr(v, "rank", 0) or 0), int(t), float(getattr(v, "logprob", v))) for t, v in (entry or {}).items()),
    )
    top = [(t, lp) for rank, t, lp in ranked if 1 <= rank <= k][:k]
    ids = [t for t, _ in top] + [0] * (k - len(top))
    return ids, [lp for _, lp in top] + [TOP_PAD_LOGPROB] * (k - len(top))


def encode_teacher_top(ids: np.ndarray, logprobs: np.ndarray) -> dict:
    """`{"ids", "logprobs"}` of a teacher's `[tokens, k]` top-k ids (int32) and logprobs (float32), JSON-able."""
    if ids.shape != logprobs.shape:
        raise ValueError(f"teacher top-k ids {ids.shape} and logprobs {logprobs.shape} differ in shape")
    return {
        "ids": _encode(ids, 2, ("int32",), "teacher top-k ids [tokens, k]"),
        "logprobs": _encode(logprobs, 2, ("float32",), "teacher top-k logprobs [tokens, k]"),
    }


def decode_teacher_top(entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """The `[tokens, k]` ids and logprobs of an `encode_teacher_top` entry; ValueError naming what is wrong."""
    try:
        ids = _decode(entry["ids"], 2, ("int32",), "teacher top-k ids")
        logprobs = _decode(entry["logprobs"], 2, ("float32",), "teacher top-k logprobs")
    except (KeyError, TypeError) as err:
        raise ValueError(f"teacher top-k entry is not {{ids, logprobs}}: {err}") from None
    if ids.shape != logprobs.shape:
        raise ValueError(f"teacher top-k ids {ids.shape} and logprobs {logprobs.shape} differ in shape")
    return ids, logprobs
