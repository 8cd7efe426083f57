"""Routing replay in Megatron's MoE routers (`trainer/routing_replay.py`), gloo processes, fp32, tiny Qwen3-MoE.

Checkpoint B is checkpoint A with its router weights perturbed, so that some top-k choices flip. Megatron records
A's routes, then on B routes freely (agreement with A below 1) and replays A's routes: every replayed token is
dispatched to exactly A's experts (agreement 1.0), the logprobs are transformers' on B with A's experts forced
(gate weights from B's own router logits), and without replay they are measurably different. Free tokens
(the last position, a padded tail) route as B's own routers choose. With pipeline parallel 1, router gradients
under replay are the same with activation recompute as without (recompute replays in the backward pass).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.torchrun import run_torchrun
from megatron_rl.verify.parity import parity_tokens
from tests.support.hf_routes import hf_routes_and_logprobs, perturbed_router_copy

WORKER = "tests.support.routing_replay_worker"
LAYOUTS = {
    "1x1x1": ParallelLayout(),
    "tp2xep2": ParallelLayout(tp=2, ep=2, etp=1),
    "pp2": ParallelLayout(pp=2),
}
ROWS, SEQ, MBS = 4, 32, 2
TOLERANCE = 1e-4
NOISE = 0.3
"""Router noise in units of the router weights' own std: flips a share of the (token, layer) choices."""


def _free_mask() -> torch.Tensor:
    """The last position of every row (no engine route there) and the last 8 of row 3 (like padding)."""
    free = torch.zeros(ROWS, SEQ, dtype=torch.bool)
    free[:, -1] = True
    free[3, -8:] = True
    return free


@pytest.fixture(scope="module")
def results(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("routing-replay")
    hf_a = tiny_dir("qwen3_moe")
    hf_b = perturbed_router_copy(hf_a, root / "perturbed", NOISE)
    tokens = parity_tokens(512, ROWS, SEQ, seed=3)
    torch.save(tokens, root / "tokens.pt")
    torch.save(_free_mask(), root / "free.pt")
    cases: dict[int, list[dict]] = {}
    for name, layout in LAYOUTS.items():
        case = {"name": name, "hf_a": hf_a, "hf_b": str(hf_b), "layout": layout.__dict__, "micro_batch_size": MBS,
                "tokens": str(root / "tokens.pt"), "free": str(root / "free.pt"), "out": str(root / f"{name}.pt")}  # fmt: skip
        cases.setdefault(layout.world_size, []).append(case)
    for world, world_cases in sorted(cases.items()):
        spec = root / f"spec{world}.json"
        spec.write_text(json.dumps({"cases": world_cases}))
        run_torchrun(WORKER, [str(spec)], world, timeout_s=180 * len(world_cases), log_path=root / f"log{world}.txt")
    out = {name: torch.load(root / f"{name}.pt") for name in LAYOUTS}
    routes_a_hf, _ = hf_routes_and_logprobs(hf_a, tokens)
    _, forced = hf_routes_and_logprobs(hf_b, tokens, forced=out["1x1x1"]["routes_a"], free=_free_mask())
    _, free_b = hf_routes_and_logprobs(hf_b, tokens)
    return {"layouts": out, "hf_routes_a": routes_a_hf, "hf_forced_b": forced, "hf_free_b": free_b}


def _fraction(counts) -> float:
    equal, total = counts
    assert total > 0
    return equal / total


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_dispatches_exactly_the_recorded_experts(results, name):
    got = results["layouts"][name]
    free_agreement = _fraction(got["agree_free"])
    print(f"{name}: agreement of B's free routes with A's {free_agreement:.3f}")
    assert 0.3 < free_agreement < 0.95  # the perturbation flips a real share of the choices
    assert _fraction(got["agree_used"]) == 1.0
    assert _fraction(got["free_used_is_own"]) == 1.0  # free tokens take the router's own choice
    assert got["agree_used"][1] == (ROWS * SEQ - int(_free_mask().sum())) * 2  # every non-free (token, layer)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replayed_logprobs_are_those_of_the_forced_experts(results, name):
    got = results["layouts"][name]
    forced = results["hf_forced_b"]
    replay_diff = float((got["logprobs_replay"] - forced).abs().max())
    free_diff = float((got["logprobs_b"] - forced).abs().max())
    print(f"{name}: replay vs transformers forced {replay_diff:.3g}; free routing vs forced {free_diff:.3g}")
    assert replay_diff <= TOLERANCE
    assert float((got["logprobs_b"] - results["hf_free_b"]).abs().max()) <= TOLERANCE
    assert free_diff > 100 * TOLERANCE


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recorded_routes_are_the_routers_choices(results, name):
    """RECORD gives the experts transformers' routers choose on the same checkpoint (exact ties aside)."""
    got = results["layouts"][name]
    agreement = (got["routes_a"].sort(-1).values == results["hf_routes_a"].sort(-1).values).all(-1).double().mean()
    print(f"{name}: recorded routes vs transformers' {float(agreement):.4f}")
    assert float(agreement) >= 0.99


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.pp == 1])
def test_replay_holds_through_activation_recompute(results, name):
    got = results["layouts"][name]
    print(f"{name}: router grad norm {got['grad_norm']:.3g}, recompute diff {got['grad_recompute_diff']:.3g}")
    assert got["backward_router_calls"] == (0, 2)  # with recompute, both layers' routers ran again in backward
    assert got["grad_norm"] > 0  # the gate weights come from the trainer's own router: gradients flow
    assert got["grad_recompute_diff"] <= 1e-6 * max(1.0, got["grad_norm"])
    assert got["grad_free_vs_replay_diff"] > 1e-3 * got["grad_norm"]  # replay changes the gradient


def test_router_fusion_is_refused(results):
    assert "moe_router_fusion" in results["layouts"]["1x1x1"]["refused"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_sequences_replay_the_same_experts(results, name):
    """The replayed forward with its sequences packed end to end (the routes packed alike) gives the padded
    forward's logprobs at every position of every sequence (row 3 is shorter: compared up to its length)."""
    got = results["layouts"][name]
    valid = torch.ones(ROWS, SEQ - 1, dtype=torch.bool)
    valid[3, int((~_free_mask()[3]).sum()) :] = False
    diff = float((got["logprobs_replay_packed"] - got["logprobs_replay"])[valid].abs().max())
    print(f"{name}: packed vs padded replay {diff:.3g}")
    assert diff <= 1e-5
