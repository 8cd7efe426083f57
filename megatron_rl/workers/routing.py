"""torchrun worker of `verify routing`: the trainer at a layout on the unperturbed checkpoint computes the logprobs
of an engine's sequences routing freely and replaying the engine's routes, with the router agreement of both.

Spec file (JSON):
    hf, layout        the checkpoint and the ParallelLayout fields
    temperature       the engine's sampling temperature (the trainer divides its logits by it)
    dtype             (optional) the trainer's parameter dtype, float32 unless given (the engine's)
    tokens, free      paths of the [B, S] token tensor and its [B, S] bool free-routing mask (the last position of
                      each sequence, which the engine never computed, and padding)
    routes            path of the engine's [B, S, L, k] routes of the tokens
    micro_batch_size  rows per micro-batch
    out               where the owner rank (last stage, TP 0, DP 0) writes the results
"""

from __future__ import annotations

import torch

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.logprobs import forward_logprobs
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.routing_replay import RoutingReplay
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.workers import run_worker


def check(spec: dict, _startup_s: float) -> None:
    """Both forwards; the owner rank writes logprobs `[B, S-1]` and (equal, total) agreements with the engine's
    routes: free routing, the experts dispatched under replay, and the routers' own choices under replay."""
    layout = ParallelLayout(**spec["layout"])
    mbs = int(spec["micro_batch_size"])
    opts = BuildOptions(
        logit_temperature=float(spec["temperature"]), init_weights=False, dtype=spec.get("dtype", "float32")
    )
    rank = bring_up_from_hf(spec["hf"], layout, opts)
    model, ctx = rank.model, rank.ctx
    tokens, free, routes = (torch.load(spec[name]) for name in ("tokens", "free", "routes"))
    valid = ~free
    replay = RoutingReplay(model)
    out: dict = {}
    with replay.recording():
        out["logprobs_free"] = forward_logprobs(model, ctx, tokens, mbs)
    out["agree_free"] = replay.agreement(replay.recorded_routes(mbs), routes, valid)
    with replay.replaying(routes, free, mbs, record=True), replay.dispatched(mbs) as used:
        out["logprobs_replay"] = forward_logprobs(model, ctx, tokens, mbs)
    out["agree_replay"] = replay.agreement(used["routes"], routes, valid)
    # The routers' own choices on the replayed (the engine's) hidden states: they differ where the engine flipped.
    out["agree_own_under_replay"] = replay.agreement(replay.recorded_routes(mbs), routes, valid)
    if ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        torch.save(out, spec["out"])


if __name__ == "__main__":
    run_worker(check)
