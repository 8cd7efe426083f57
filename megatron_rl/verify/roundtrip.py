"""Compare two HF checkpoints tensor by tensor (names, shapes, dtypes, bit-identical values)."""

from __future__ import annotations

import torch

from megatron_rl.models.hf_checkpoint import HFCheckpoint


def compare_hf_checkpoints(a: str, b: str) -> dict:
    """A report: missing/extra names, shape and dtype mismatches, tensors that differ, and the largest difference."""
    ca, cb = HFCheckpoint(a), HFCheckpoint(b)
    names_a, names_b = set(ca.names()), set(cb.names())
    report = {
        "tensors": len(names_a),
        "only_in_first": sorted(names_a - names_b),
        "only_in_second": sorted(names_b - names_a),
        "shape_mismatch": [],
        "dtype_mismatch": [],
        "value_mismatch": [],
        "max_abs_diff": 0.0,
    }
    for name in sorted(names_a & names_b):
        ta, tb = ca.get(name), cb.get(name)
        if ta.shape != tb.shape:
            report["shape_mismatch"].append(name)
            continue
        if ta.dtype != tb.dtype:
            report["dtype_mismatch"].append(name)
        if not torch.equal(ta, tb.to(ta.dtype)):
            report["value_mismatch"].append(name)
            diff = (ta.double() - tb.double()).abs().max().item()
            report["max_abs_diff"] = max(report["max_abs_diff"], diff)
    report["identical"] = not any(
        report[k] for k in ("only_in_first", "only_in_second", "shape_mismatch", "dtype_mismatch", "value_mismatch")
    )
    return report
