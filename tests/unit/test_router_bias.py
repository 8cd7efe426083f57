"""The engine routers' selection-only perturbation of `verify routing` (`weights/engine/router_bias.py`), pure torch."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from megatron_rl.weights.engine.router_bias import _check_router, biased_topk, expert_bias, flipped


def _logits() -> torch.Tensor:
    return torch.randn(256, 8, generator=torch.Generator().manual_seed(0))


def test_without_a_bias_it_is_the_plain_softmax_top_k():
    z = _logits()
    weights, ids, own = biased_topk(z, expert_bias(8, 0, 1), 0.0, 2, renormalize=True)
    top = torch.topk(z, 2, dim=-1)
    assert flipped(ids, own) == 0 and ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long().sort(-1).values, top.indices.sort(-1).values)
    assert torch.allclose(weights.sort(-1).values, torch.softmax(top.values, -1).sort(-1).values)


@pytest.mark.parametrize("renormalize", [True, False])
def test_a_bias_flips_choices_but_weights_stay_the_true_logits(renormalize):
    z = _logits()
    weights, ids, own = biased_topk(z, expert_bias(8, 0, 1), 0.5, 2, renormalize)
    share = flipped(ids, own) / z.shape[0]
    assert 0.05 < share < 0.9
    chosen = ids.long()
    want = torch.softmax(z.gather(1, chosen), -1) if renormalize else torch.softmax(z, -1).gather(1, chosen)
    assert torch.allclose(weights, want, atol=1e-6)
    # the biased logits would give other weights: the perturbation is in the selection only
    biased = z + 0.5 * z.std(-1, keepdim=True, unbiased=False) * expert_bias(8, 0, 1)
    assert not torch.allclose(weights, torch.softmax(biased.gather(1, chosen), -1), atol=1e-3)


def test_the_bias_is_fixed_per_seed_and_layer():
    assert torch.equal(expert_bias(8, 3, 0), expert_bias(8, 3, 0))
    assert not torch.equal(expert_bias(8, 3, 0), expert_bias(8, 3, 1))
    assert not torch.equal(expert_bias(8, 3, 0), expert_bias(8, 4, 0))


def test_a_routing_it_cannot_reproduce_is_refused_naming_the_layer():
    plain = types.SimpleNamespace(use_grouped_topk=False, scoring_func="softmax", renormalize=True)
    _check_router(plain, 0)
    grouped = types.SimpleNamespace(use_grouped_topk=True, scoring_func="sigmoid", renormalize=True)
    with pytest.raises(ValueError, match=r"MoE layer 3 .*grouped top-k, scoring 'sigmoid'"):
        _check_router(grouped, 3)


def test_sequences_route_the_last_position_and_padding_freely():
    from megatron_rl.verify.routing import sequences  # imports Ray: only this test needs it

    results = [types.SimpleNamespace(prompt_ids=[1, 2, 3], token_ids=[4, 5]) for _ in range(2)]
    routes = [np.full((4, 2, 2), i + 1, dtype=np.uint8) for i in range(2)]
    tokens, free, padded = sequences({"results": results, "routes": routes}, tp=2)
    assert tokens.shape == (2, 6) and tokens[0].tolist() == [1, 2, 3, 4, 5, 0]
    assert free[0].tolist() == [False] * 4 + [True, True]
    assert padded.shape == (2, 6, 2, 2) and int(padded[1, :4].min()) == 2 and int(padded[:, 4:].abs().sum()) == 0
    with pytest.raises(RuntimeError, match="3 routed positions for a sequence of 5 tokens"):
        sequences({"results": results, "routes": [r[:3] for r in routes]}, tp=1)


def test_the_check_fails_unless_replay_meets_its_targets():
    from megatron_rl.verify.routing import failures  # imports Ray: only this test needs it

    good = {"flip_fraction": 0.2, "agreement_without_replay": 0.8, "agreement_with_replay": 1.0,
            "max_abs_logprob_diff_with_replay": 3e-6, "tolerance": 1e-5}  # fmt: skip
    assert failures(good) == []
    assert "flipped no routing choice" in failures({**good, "flip_fraction": 0.0, "agreement_without_replay": 1.0})[0]
    assert "agreement with replay 0.990000" in failures({**good, "agreement_with_replay": 0.99})[0]
    assert "with replay 0.002 > 1e-05" in failures({**good, "max_abs_logprob_diff_with_replay": 2e-3})[0]
    assert failures({**good, "max_abs_logprob_diff_with_replay": float("nan")})  # a NaN never passes
