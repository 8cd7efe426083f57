"""torchrun worker of `tests/distributed/test_routing_replay.py`: record routes on checkpoint A, load checkpoint B
(A with perturbed routers) into the same model, route freely and replay A's routes, at a layout.

Spec file (JSON): {"cases": [case, ...]}; each case:
    hf_a, hf_b        the checkpoint and its perturbed-router copy
    layout            ParallelLayout fields
    tokens, free      paths of the [B, S] token tensor and its [B, S] bool free-routing mask
    micro_batch_size  rows per micro-batch (the forwards run several, in Megatron's schedule)
    engine_routes     (optional) path of [B, S, L, k] routes an engine computed for the tokens on hf_a: their
                      agreement with the routes Megatron records is reported
    out               where the owner rank (last stage, TP 0, DP 0) writes the results

With pipeline parallel 1 the case also compares router gradients under replay with activation recompute on and off
(recompute re-runs each layer's routers inside the backward pass).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.hf_weights import load_hf_into_model
from megatron_rl.trainer.logprobs import forward_logprobs, model_inputs
from megatron_rl.trainer.micro_batches import plan_micro_batches
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.packing import MicroBatching
from megatron_rl.trainer.routing_replay import RoutingReplay, RoutingReplayError, in_backward_pass
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.workers import run_cases


def _routers(model) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def router_grads(model, replay, tokens, routes, free, recompute: bool) -> tuple[torch.Tensor, int]:
    """(gradient of the summed next-token losses w.r.t. every router weight of this rank, how many router calls ran
    inside the backward pass), for one micro-batch replaying `routes` (unless None), with full activation
    recompute on or off."""
    config = replay.config
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers = (
        ("full", "uniform", 1) if recompute else (None, None, None)
    )
    model.train()
    model.zero_grad(set_to_none=True)
    inputs = model_inputs(tokens, next(model.parameters()).device)
    block = replay.replaying(routes, free, tokens.shape[0]) if routes is not None else contextlib.nullcontext()
    in_backward = []
    handles = [r.register_forward_hook(lambda *_: in_backward.append(in_backward_pass())) for r in _routers(model)]
    try:
        with block:
            model(**inputs)[:, :-1].sum().backward()
    finally:
        config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None
        model.eval()
        for handle in handles:
            handle.remove()
    return torch.cat([r.weight.grad.flatten().clone() for r in _routers(model)]), sum(in_backward)


def refused_fusion(model) -> str:
    """The error RoutingReplay gives for a model whose routers are fused ('' if none)."""
    config = _routers(model)[0].config
    config.moe_router_fusion = True
    try:
        RoutingReplay(model)
    except RoutingReplayError as err:
        return str(err)
    finally:
        config.moe_router_fusion = False
    return ""


def _grad_checks(model, replay, tokens, routes, free) -> dict:
    replayed, calls = router_grads(model, replay, tokens, routes, free, recompute=False)
    replayed_recompute, recompute_calls = router_grads(model, replay, tokens, routes, free, recompute=True)
    free_grads, _ = router_grads(model, replay, tokens, None, None, recompute=True)
    return {
        "backward_router_calls": (calls, recompute_calls),
        "grad_norm": float(replayed.norm()),
        "grad_recompute_diff": float((replayed - replayed_recompute).abs().max()),
        "grad_free_vs_replay_diff": float((replayed - free_grads).abs().max()),
    }


def _packed_replay(model, ctx, replay, tokens, routes, free, mbs):
    """The replayed forward again with the sequences packed (row 3 ends where its free tail begins): the
    routes travel packed as `BatchRouting` packs them (`MicroBatchPlan.routes`)."""
    lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long)
    lengths[3] = int((~free[3]).sum()) + 1  # its last real token routes freely too
    plan = plan_micro_batches(tokens, lengths, MicroBatching(size=mbs, pack=True), ctx)
    packed_routes, packed_free = plan.routes(routes, free)
    with replay.replaying(packed_routes, packed_free, plan.rows_per_micro_batch):
        return forward_logprobs(model, ctx, tokens, plan, lengths=lengths)


def run_case(case: dict) -> None:
    layout = ParallelLayout(**case["layout"])
    mbs = int(case["micro_batch_size"])
    rank = bring_up_from_hf(case["hf_a"], layout, BuildOptions(init_weights=False))
    model, ctx = rank.model, rank.ctx
    tokens, free = torch.load(case["tokens"]), torch.load(case["free"])
    out: dict = {"refused": refused_fusion(model)}
    replay = RoutingReplay(model)
    with replay.recording():
        out["logprobs_a"] = forward_logprobs(model, ctx, tokens, mbs)
    routes_a = replay.recorded_routes(mbs, all_layers=True)
    if case.get("engine_routes"):  # an engine's routes of the same tokens at A's weights: the router agreement
        out["agree_engine"] = replay.agreement(replay.recorded_routes(mbs), torch.load(case["engine_routes"]), ~free)
    load_hf_into_model(model, HFCheckpoint(case["hf_b"]), rank.family, rank.arch, ctx)
    with replay.recording():
        out["logprobs_b"] = forward_logprobs(model, ctx, tokens, mbs)
    out["routes_b"] = replay.recorded_routes(mbs, all_layers=True)
    out["agree_free"] = replay.agreement(replay.recorded_routes(mbs), routes_a)
    with replay.replaying(routes_a, free, mbs, record=True), replay.dispatched(mbs) as used:
        out["logprobs_replay"] = forward_logprobs(model, ctx, tokens, mbs)
    out["own_under_replay"] = replay.recorded_routes(mbs, all_layers=True)
    out["logprobs_replay_packed"] = _packed_replay(model, ctx, replay, tokens, routes_a, free, mbs)
    valid = ~free
    out["agree_used"] = replay.agreement(used["routes"], routes_a, valid)
    out["free_used_is_own"] = replay.agreement(used["routes"], out["own_under_replay"], free)
    if layout.pp == 1:
        out.update(_grad_checks(model, replay, tokens, routes_a, free))
    out["routes_a"] = routes_a
    if ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        torch.save(out, case["out"])


if __name__ == "__main__":
    run_cases(run_case)
