"""algorithms/: advantages, masked reductions and the loss aggregations, entropy, step metrics and distillation,
against float64 references written here with loops over python floats (no calls into the implementation).

The shared data (also used by test_corrections.py, test_losses.py and test_kl.py) is off-policy (behaviour !=
proximal != current logprobs), with extreme ratios (log ratios of +-25 to +-100, beyond every clamp), masks of
variable lengths with holes, NaN in the padding (it must never reach a result or a gradient), and groups of
several sizes.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from megatron_rl import algorithms as alg

TOL = {"rtol": 1e-10, "atol": 1e-12}
AGGS = ("token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
NORM_TOKENS = 7

# ----------------------------------------------------------------------------------------------------------------
# data


def make_batch(seed: int = 0, batch: int = 12, seq: int = 9, dtype=torch.float64, extreme: bool = True) -> dict:
    """Off-policy token data with NaN padding: row 0 is all-masked, row 1 full, row 2 has proximal == behaviour;
    with `extreme`, rows 3 and 4 hold log ratios far beyond the clamps (+-25 .. +-100)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[0], lengths[1] = 0, seq
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    holes = torch.rand(batch, seq, generator=g) < 0.15
    holes[1] = False
    mask &= ~holes
    mask[3, :3] = mask[4, :3] = True
    behav = -4.0 * torch.rand(batch, seq, generator=g, dtype=torch.float64) - 0.01
    prox = behav + 0.5 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
    prox[2] = behav[2]  # ratios exactly 1
    cur = prox + 0.3 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
    ref = cur + 0.4 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
    if extreme:
        prox[3, 0], prox[3, 1], prox[4, 0] = behav[3, 0] + 30.0, behav[3, 1] - 100.0, behav[4, 0] - 25.0
        cur[3, 2], cur[4, 1] = prox[3, 2] + 25.0, prox[4, 1] - 60.0
        ref[3, 0], ref[4, 2] = cur[3, 0] + 100.0, cur[4, 2] - 100.0
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    out = {name: torch.where(mask, t, nan).to(dtype) for name, t in [("behav", behav), ("prox", prox), ("cur", cur)]}
    out["ref"] = torch.where(mask, ref, nan).to(dtype)
    out["adv"] = adv.to(dtype)
    out["mask"] = mask
    return out


def rows(t: torch.Tensor) -> list:
    """Nested python floats (bools stay bools)."""
    return t.detach().tolist() if t.dtype == torch.bool else t.detach().double().tolist()


def close(actual, expected, **tol) -> None:
    """Tensor (any dtype) vs python/numpy reference, compared in float64."""
    tol = tol or TOL
    np.testing.assert_allclose(torch.as_tensor(actual).detach().double().numpy(), np.asarray(expected, float), **tol)


def clamp(x: float, bound: float = 20.0) -> float:
    """x clamped to [-bound, bound] (the bound every log ratio gets before exp, as verl)."""
    return max(-bound, min(bound, x))


# ----------------------------------------------------------------------------------------------------------------
# references (float64, loops, no calls into the implementation)


def ref_aggregate(values, grads, mask, agg: str, normalizer=None, norm_tokens: int = NORM_TOKENS):
    """Aggregated loss and d(loss)/d(token) given per-token values and per-token derivatives."""
    nb, nt = len(mask), len(mask[0])
    dloss = [[0.0] * nt for _ in range(nb)]
    toks = [[t for t in range(nt) if mask[i][t]] for i in range(nb)]
    nonempty = [i for i in range(nb) if toks[i]]
    if agg in ("token_mean", "seq_mean_token_sum_norm"):
        n = sum(len(x) for x in toks) if agg == "token_mean" else nb * norm_tokens
        denom = normalizer if normalizer is not None else max(n, 1)
        for i in range(nb):
            for t in toks[i]:
                dloss[i][t] = grads[i][t] / denom
        return sum(values[i][t] for i in range(nb) for t in toks[i]) / denom, dloss
    denom = normalizer if normalizer is not None else max(len(nonempty), 1)
    total = 0.0
    for i in nonempty:
        per = 1.0 / len(toks[i]) if agg == "seq_mean" else 1.0
        total += per * sum(values[i][t] for t in toks[i])
        for t in toks[i]:
            dloss[i][t] = per * grads[i][t] / denom
    return total / denom, dloss


def ref_groups(rewards: list[float], ids: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(ids):
        members.setdefault(gid, []).append(i)
    return members


def ref_grpo(rewards: list[float], ids: list[int], normalize_std: bool, eps: float = 1e-6) -> list[float]:
    """GRPO (Shao et al. 2024): (r - mean) / (std + eps) per group; Dr. GRPO (Liu et al. 2025) drops the std."""
    out = [0.0] * len(rewards)
    for idx in ref_groups(rewards, ids).values():
        vals = [rewards[i] for i in idx]
        n = len(vals)
        if n < 2 or all(v == vals[0] for v in vals):
            continue
        mean = math.fsum(vals) / n
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1))
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + eps) if normalize_std else rewards[i] - mean
    return out


def ref_rloo(rewards: list[float], ids: list[int]) -> list[float]:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the group's other rewards."""
    out = [0.0] * len(rewards)
    for idx in ref_groups(rewards, ids).values():
        if len(idx) < 2 or all(rewards[i] == rewards[idx[0]] for i in idx):
            continue
        for i in idx:
            others = [rewards[j] for j in idx if j != i]
            out[i] = rewards[i] - math.fsum(others) / len(others)
    return out


def ref_ess(weights: list[float]) -> float:
    s1, s2 = sum(weights), sum(x * x for x in weights)
    return 0.0 if not weights or s2 == 0 else s1 * s1 / s2 / len(weights)


def ref_entropy(logits: list[float]) -> tuple[float, list[float]]:
    """-sum p log p of softmax(logits) and its derivative in each logit, -p_v (z_v - sum_u p_u z_u)."""
    top = max(logits)
    exps = [math.exp(z - top) for z in logits]
    total = math.fsum(exps)
    p = [e / total for e in exps]
    mean_z = math.fsum(pv * z for pv, z in zip(p, logits))
    return -math.fsum(pv * math.log(pv) for pv in p if pv > 0), [-pv * (z - mean_z) for pv, z in zip(p, logits)]


# ----------------------------------------------------------------------------------------------------------------
# advantages

IDS = [5, 5, 5, 9, 2, 2, 7, 7, 7, 7, 7, 7, 4, 4, 4, 4]  # sizes 3, 1, 2, 6, 4


def group_rewards(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards with shuffled group ids; group 4 has all rewards equal (0.1: sums are inexact in binary)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(IDS), generator=g)
    ids = torch.tensor(IDS)[perm]
    rewards = torch.randn(len(IDS), generator=g, dtype=torch.float64)
    rewards[ids == 4] = 0.1
    return rewards, ids


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["grpo", "grpo_no_std", "rloo"])
def test_advantages_match_reference(kind, seed):
    rewards, ids = group_rewards(seed)
    r, i = rows(rewards), ids.tolist()
    expected = ref_rloo(r, i) if kind == "rloo" else ref_grpo(r, i, normalize_std=kind == "grpo")
    got = alg.compute_advantages(kind, rewards, group_ids=ids)
    close(got, expected)
    assert torch.all(got[ids == 4] == 0) and torch.all(got[ids == 9] == 0)  # exactly 0, no NaN
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("kind", ["grpo", "grpo_no_std", "rloo"])
def test_advantages_fixed_group_size_equals_ids(kind):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 2, (12,), generator=g).double()  # 0/1 rewards: some groups have zero variance
    ids = torch.arange(12) // 4
    close(alg.compute_advantages(kind, rewards, group_size=4), rows(alg.compute_advantages(kind, rewards, ids)))
    r = rows(rewards)
    expected = ref_rloo(r, ids.tolist()) if kind == "rloo" else ref_grpo(r, ids.tolist(), kind == "grpo")
    close(alg.compute_advantages(kind, rewards, group_size=4), expected)


def test_advantages_of_huge_rewards_stay_exact_in_float64():
    """Rewards near 1e20 (a spread of 1e5) and near 1e30: float32 loses them (all-zero or NaN advantages)."""
    rewards = torch.tensor([1e20, 1e20 + 2**17, 1e20 + 2**19, 1e30, -1e30, 3e30], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    for kind in ("grpo", "grpo_no_std", "rloo"):
        got = alg.compute_advantages(kind, rewards, group_ids=ids)
        r = rows(rewards)
        expected = ref_rloo(r, ids.tolist()) if kind == "rloo" else ref_grpo(r, ids.tolist(), kind == "grpo")
        close(got, expected, rtol=1e-9, atol=1e-12)
        assert torch.isfinite(got).all() and bool((got[:3] != 0).all())


def test_advantages_float32_and_integer_rewards():
    rewards, ids = group_rewards(2)
    expected = ref_grpo(rows(rewards.float()), ids.tolist(), normalize_std=True)
    got = alg.grpo_advantages(rewards.float(), ids)
    assert got.dtype == torch.float32
    close(got, expected, rtol=1e-5, atol=1e-6)
    ints = torch.tensor([1, 0, 1, 1, 0, 0])
    close(alg.rloo_advantages(ints, group_size=3), ref_rloo([1.0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]))


def test_group_size_one_everywhere_gives_zero():
    rewards = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    for kind in alg.ADVANTAGE_ESTIMATORS:
        assert torch.equal(alg.compute_advantages(kind, rewards, group_size=1), torch.zeros(3, dtype=torch.float64))


def test_advantage_errors_are_named():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="exactly one of group_ids and group_size"):
        alg.grpo_advantages(r)
    with pytest.raises(ValueError, match="group_size=4: must be positive and divide the batch"):
        alg.grpo_advantages(r, group_size=4)
    with pytest.raises(ValueError, match="advantage estimator 'ppo'"):
        alg.compute_advantages("ppo", r, group_size=2)


def test_broadcast_to_tokens():
    data = make_batch(4)
    mask, adv = rows(data["mask"]), rows(data["adv"])
    expected = [[adv[i] if mask[i][t] else 0.0 for t in range(len(mask[0]))] for i in range(len(mask))]
    close(alg.broadcast_to_tokens(data["adv"], data["mask"].float()), expected)


# ----------------------------------------------------------------------------------------------------------------
# masked reductions and aggregations


def test_masked_reductions_ignore_padding():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 2.0, -4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    close(alg.masked_sum(x, mask), 2.0)
    close(alg.masked_mean(x, mask), 0.5)
    close(alg.masked_mean(x, mask, dim=-1), [2.0, -1.0])
    close(alg.masked_max(x, mask), 3.0)
    close(alg.masked_min(x, mask), -4.0)
    close(alg.aggregate_loss(x, mask, "seq_mean"), 0.5)
    close(alg.aggregate_loss(x, mask, "seq_mean_token_sum"), (4.0 - 2.0) / 2)
    close(alg.aggregate_loss(x, mask, "seq_mean_token_sum_norm", norm_tokens=5), 2.0 / (2 * 5))
    with pytest.raises(ValueError, match="loss aggregation 'sum'"):
        alg.aggregate_loss(x, mask, "sum")
    with pytest.raises(ValueError, match="needs norm_tokens"):
        alg.aggregate_loss(x, mask, "seq_mean_token_sum_norm")


@pytest.mark.parametrize("agg", AGGS)
def test_aggregations_value_gradient_and_shares(agg):
    """Each aggregation against its formula, and the sum of shares (numerator over a global denominator) equals
    the whole batch, as the trainer's micro-batches and data-parallel ranks compute it."""
    data = make_batch(20)
    x = data["cur"].clone().requires_grad_(True)
    loss = alg.aggregate_loss(x, data["mask"], agg, norm_tokens=NORM_TOKENS)
    loss.backward()
    m, v = rows(data["mask"]), rows(data["cur"])
    ones = [[1.0] * len(m[0]) for _ in m]
    ref_loss, ref_grad = ref_aggregate(v, ones, m, agg)
    close(loss, ref_loss)
    close(x.grad, ref_grad)
    denom = sum(alg.loss_denominator(data["mask"][r : r + 3], agg, NORM_TOKENS) for r in range(0, 12, 3))
    parts = sum(alg.loss_numerator(data["cur"][r : r + 3], data["mask"][r : r + 3], agg) for r in range(0, 12, 3))
    close(parts / denom, ref_loss)
    empty = alg.aggregate_loss(x, torch.zeros_like(data["mask"]), agg, norm_tokens=NORM_TOKENS)
    assert empty.item() == 0.0


# ----------------------------------------------------------------------------------------------------------------
# entropy


def test_entropy_value_and_gradient_match_reference():
    g = torch.Generator().manual_seed(21)
    logits = 3 * torch.randn(4, 3, 11, generator=g, dtype=torch.float64)
    logits[0, 0, 3] = 80.0  # one dominant logit: the shift keeps exp finite
    x = logits.clone().requires_grad_(True)
    h = alg.entropy_from_logits(x)
    h.sum().backward()
    for b in range(4):
        for s in range(3):
            value, grad = ref_entropy(rows(logits[b, s]))
            close(h[b, s], value, rtol=1e-9, atol=1e-12)
            close(x.grad[b, s], grad, rtol=1e-9, atol=1e-12)


def test_entropy_over_a_split_vocabulary_equals_the_whole():
    """Two 'tensor-parallel ranks' (threads) each hold half of the vocabulary and all-reduce max and sums."""
    g = torch.Generator().manual_seed(22)
    logits = 2 * torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    barrier, slots = threading.Barrier(2), [None, None]

    def all_reduce(rank: int, op):
        def reduce(x):
            slots[rank] = x
            barrier.wait()
            out = op(slots[0], slots[1])
            barrier.wait()
            return out

        return reduce

    results = [None, None]

    def rank_main(rank: int):
        shard = logits[..., rank * 8 : (rank + 1) * 8]
        results[rank] = alg.entropy_from_logits(shard, all_reduce(rank, torch.maximum), all_reduce(rank, torch.add))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = [[ref_entropy(rows(logits[b, s]))[0] for s in range(5)] for b in range(3)]
    close(results[0], expected, rtol=1e-9, atol=1e-12)
    close(results[1], expected, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# metrics


def test_mismatch_metrics():
    data = make_batch(15, extreme=False)
    train, roll, m = rows(data["prox"]), rows(data["behav"]), rows(data["mask"])
    diffs = [train[i][t] - roll[i][t] for i in range(len(m)) for t in range(len(m[0])) if m[i][t]]
    got = alg.mismatch_metrics(data["prox"], data["behav"], data["mask"].float())
    close(got["mismatch/k3_kl"], sum(math.exp(d) - 1 - d for d in diffs) / len(diffs))
    close(got["mismatch/abs_diff_mean"], sum(abs(d) for d in diffs) / len(diffs))
    close(got["mismatch/abs_diff_max"], max(abs(d) for d in diffs))
    empty = alg.mismatch_metrics(data["prox"], data["behav"], torch.zeros_like(data["mask"]))
    assert all(v.item() == 0 for v in empty.values())
    wild = alg.mismatch_metrics(make_batch(15)["prox"], make_batch(15)["behav"], make_batch(15)["mask"])
    assert all(torch.isfinite(v) for v in wild.values())


def test_fresh_mismatch_metrics_cover_only_the_tokens_of_the_trainers_version():
    """Staleness apart: only the tokens the engine sampled with the trainer's own version (float32 inputs, as
    the trainer's logprobs are) against a float64 reference over those tokens; the count and share they cover."""
    data = make_batch(17, extreme=False)
    g = torch.Generator().manual_seed(18)
    versions = torch.randint(3, 6, data["mask"].shape, generator=g)
    train, roll = data["prox"].float(), data["behav"].float()
    got = alg.fresh_mismatch_metrics(train, roll, data["mask"].float(), versions, 5)
    m, v = rows(data["mask"]), rows(versions)
    cells = [(i, t) for i in range(len(m)) for t in range(len(m[0])) if m[i][t]]
    fresh = [(i, t) for i, t in cells if v[i][t] == 5]
    diffs = [float(train[i, t].double()) - float(roll[i, t].double()) for i, t in fresh]
    assert 0 < len(fresh) < len(cells)
    close(got["mismatch/fresh_k3_kl"], sum(math.exp(d) - 1 - d for d in diffs) / len(diffs), rtol=1e-5)
    close(got["mismatch/fresh_abs_diff_mean"], sum(abs(d) for d in diffs) / len(diffs), rtol=1e-5)
    close(got["mismatch/fresh_abs_diff_max"], max(abs(d) for d in diffs), rtol=1e-5)
    assert got["mismatch/fresh_tokens"].item() == len(fresh)
    close(got["mismatch/fresh_frac"], len(fresh) / len(cells))
    none = alg.fresh_mismatch_metrics(train, roll, data["mask"], versions, 9)
    assert all(value.item() == 0 for value in none.values())


def test_effective_sample_size_and_is_stats():
    g = torch.Generator().manual_seed(16)
    w = torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(4, 5, generator=g) > 0.3
    w_nan = torch.where(mask, w, torch.tensor(float("nan"), dtype=torch.float64))
    flat = [x for x, keep in zip(rows(w.flatten()), mask.flatten().tolist()) if keep]
    close(alg.effective_sample_size(w_nan, mask), ref_ess(flat))
    stats = alg.is_weight_stats(w_nan, mask)
    close(stats["is/weight_mean"], sum(flat) / len(flat))
    close(stats["is/weight_max"], max(flat))
    close(stats["is/weight_min"], min(flat))
    ones = torch.ones(3, 3)
    close(alg.effective_sample_size(ones, ones), 1.0)
    one_hot = torch.zeros(1, 4)
    one_hot[0, 2] = 7.0
    close(alg.effective_sample_size(one_hot, torch.ones(1, 4)), 0.25)
    assert alg.effective_sample_size(torch.zeros(2, 2), torch.ones(2, 2)) == 0
    assert alg.effective_sample_size(ones, torch.zeros(3, 3)) == 0


def test_distillation_rewards():
    data = make_batch(17)
    student, teacher, m = rows(data["cur"]), rows(data["ref"]), rows(data["mask"])
    nb, nt = len(m), len(m[0])
    expected = [[teacher[i][t] - student[i][t] if m[i][t] else 0.0 for t in range(nt)] for i in range(nb)]
    cur = data["cur"].clone().requires_grad_(True)
    got = alg.reverse_kl_rewards(cur, data["ref"], data["mask"])
    close(got, expected)
    assert not got.requires_grad
    close(alg.sequence_reverse_kl(data["cur"], data["ref"], data["mask"]), [-sum(row) for row in expected])
