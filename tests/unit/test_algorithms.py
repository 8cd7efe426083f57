"""algorithms/: every public function against a float64 reference written here with loops over python floats.

The data is off-policy (behaviour != proximal != current logprobs), masks have variable lengths and holes,
padding holds NaN (it must never reach a result or a gradient), groups have several sizes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl import algorithms as alg

TOL = {"rtol": 1e-10, "atol": 1e-12}
CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis")
CAPS = {"none": 1.5, "tis": 1.5, "mis": 1.5, "seq_tis": 1.1, "seq_mis": 1.1}


# ----------------------------------------------------------------------------------------------------------------
# data


def make_batch(seed: int = 0, batch: int = 12, seq: int = 9, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Off-policy token data with NaN padding: row 0 is all-masked, row 1 full, row 2 has proximal == behaviour."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[0], lengths[1] = 0, seq
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    holes = torch.rand(batch, seq, generator=g) < 0.15
    holes[1] = False
    mask &= ~holes
    behav = -4.0 * torch.rand(batch, seq, generator=g, dtype=torch.float64) - 0.01
    prox = behav + 0.5 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
    prox[2] = behav[2]  # ratios exactly 1
    cur = prox + 0.3 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
    ref = cur + 0.4 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
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


# ----------------------------------------------------------------------------------------------------------------
# references (float64, loops, no calls into the implementation)


def ref_groups(rewards: list[float], ids: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(ids):
        members.setdefault(gid, []).append(i)
    return members


def ref_grpo(rewards: list[float], ids: list[int], normalize_std: bool, eps: float = 1e-6) -> list[float]:
    out = [0.0] * len(rewards)
    for idx in ref_groups(rewards, ids).values():
        vals = [rewards[i] for i in idx]
        n = len(vals)
        if n < 2 or all(v == vals[0] for v in vals):
            continue
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + eps) if normalize_std else rewards[i] - mean
    return out


def ref_rloo(rewards: list[float], ids: list[int]) -> list[float]:
    out = [0.0] * len(rewards)
    for idx in ref_groups(rewards, ids).values():
        if len(idx) < 2 or all(rewards[i] == rewards[idx[0]] for i in idx):
            continue
        for i in idx:
            others = [rewards[j] for j in idx if j != i]
            out[i] = rewards[i] - sum(others) / len(others)
    return out


def ref_importance(prox, behav, mask, correction: str, cap: float):
    """Weights, effective mask, truncated fraction, masked fraction."""
    nb, nt = len(mask), len(mask[0])
    w = [[0.0] * nt for _ in range(nb)]
    eff = [[False] * nt for _ in range(nb)]
    units = truncated = masked = 0
    for i in range(nb):
        toks = [t for t in range(nt) if mask[i][t]]
        if correction in ("none", "tis", "mis"):
            for t in toks:
                units += 1
                r = math.exp(prox[i][t] - behav[i][t])
                if correction == "none":
                    w[i][t], eff[i][t] = 1.0, True
                elif correction == "tis":
                    w[i][t], eff[i][t] = min(r, cap), True
                    truncated += r > cap
                elif r <= cap:
                    w[i][t], eff[i][t] = r, True
                else:
                    masked += 1
            continue
        if not toks:
            continue
        units += 1
        r = math.exp(sum(prox[i][t] - behav[i][t] for t in toks) / len(toks))
        for t in toks:
            if correction == "seq_tis":
                w[i][t], eff[i][t] = min(r, cap), True
            elif r <= cap:
                w[i][t], eff[i][t] = r, True
        truncated += correction == "seq_tis" and r > cap
        masked += correction == "seq_mis" and r > cap
    return w, eff, truncated / max(units, 1), masked / max(units, 1)


def ref_token_ppo(cur: float, anchor: float, adv: float, clip_low: float, clip_high: float):
    """Per-token loss -min(rA, clip(r)A), its derivative in `cur`, and (low, high) clip activity."""
    r = math.exp(cur - anchor)
    unclipped = r * adv
    clipped = min(max(r, 1 - clip_low), 1 + clip_high) * adv
    low = adv < 0 and r < 1 - clip_low
    high = adv > 0 and r > 1 + clip_high
    if unclipped <= clipped:
        return -unclipped, -adv * r, low, high
    return -clipped, 0.0, low, high


def ref_aggregate(values, grads, mask, agg: str, normalizer=None):
    """Aggregated loss and d(loss)/d(token) given per-token values and per-token derivatives."""
    nb, nt = len(mask), len(mask[0])
    dloss = [[0.0] * nt for _ in range(nb)]
    if agg == "token_mean":
        n = sum(1 for i in range(nb) for t in range(nt) if mask[i][t])
        denom = normalizer if normalizer is not None else max(n, 1)
        total = 0.0
        for i in range(nb):
            for t in range(nt):
                if mask[i][t]:
                    total += values[i][t]
                    dloss[i][t] = grads[i][t] / denom
        return total / denom, dloss
    nonempty = [i for i in range(nb) if any(mask[i])]
    denom = normalizer if normalizer is not None else max(len(nonempty), 1)
    total = 0.0
    for i in nonempty:
        toks = [t for t in range(nt) if mask[i][t]]
        total += sum(values[i][t] for t in toks) / len(toks)
        for t in toks:
            dloss[i][t] = grads[i][t] / len(toks) / denom
    return total / denom, dloss


def ref_decoupled(data, correction, cap, clip_low, clip_high, agg, normalizer=None):
    """Decoupled PPO loss, gradient in `cur`, and stats, from python floats."""
    cur, prox, behav, mask = rows(data["cur"]), rows(data["prox"]), rows(data["behav"]), rows(data["mask"])
    adv = rows(data["adv"])
    w, eff, trunc, masked = ref_importance(prox, behav, mask, correction, cap)
    nb, nt = len(mask), len(mask[0])
    vals = [[0.0] * nt for _ in range(nb)]
    grads = [[0.0] * nt for _ in range(nb)]
    ratios, lows, highs = [], 0, 0
    for i in range(nb):
        for t in range(nt):
            if eff[i][t]:
                v, g, lo, hi = ref_token_ppo(cur[i][t], prox[i][t], adv[i], clip_low, clip_high)
                vals[i][t], grads[i][t] = w[i][t] * v, w[i][t] * g
                ratios.append(math.exp(cur[i][t] - prox[i][t]))
                lows, highs = lows + lo, highs + hi
    loss, dloss = ref_aggregate(vals, grads, eff, agg, normalizer)
    n = max(len(ratios), 1)
    stats = {
        "ppo/clip_frac": (lows + highs) / n,
        "ppo/clip_frac_low": lows / n,
        "ppo/clip_frac_high": highs / n,
        "ppo/ratio_mean": sum(ratios) / n,
        "ppo/ratio_max": max(ratios, default=0.0),
        "ppo/ratio_min": min(ratios, default=0.0),
        "ppo/approx_kl": sum(r - 1 - math.log(r) for r in ratios) / n,
        "ppo/tokens": float(len(ratios)),
        "is/truncated_frac": trunc,
        "is/masked_frac": masked,
    }
    return loss, dloss, stats, w, eff


def ref_ess(weights: list[float]) -> float:
    s1, s2 = sum(weights), sum(x * x for x in weights)
    return 0.0 if not weights or s2 == 0 else s1 * s1 / s2 / len(weights)


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
    zero_var = ids == 4
    assert torch.all(got[zero_var] == 0) and torch.all(got[ids == 9] == 0)  # exactly 0, no NaN
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("kind", ["grpo", "grpo_no_std", "rloo"])
def test_advantages_fixed_group_size_equals_ids(kind):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 2, (12,), generator=g).double()  # 0/1 rewards: some groups have zero variance
    ids = torch.arange(12) // 4
    close(alg.compute_advantages(kind, rewards, group_size=4), rows(alg.compute_advantages(kind, rewards, ids)))
    expected = (
        ref_rloo(rows(rewards), ids.tolist())
        if kind == "rloo"
        else ref_grpo(rows(rewards), ids.tolist(), kind == "grpo")
    )
    close(alg.compute_advantages(kind, rewards, group_size=4), expected)


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
# importance weights


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_importance_weights_match_reference(correction, mask_dtype):
    data = make_batch(1)
    cap = CAPS[correction]
    w, eff, trunc, masked = ref_importance(rows(data["prox"]), rows(data["behav"]), rows(data["mask"]), correction, cap)
    res = alg.importance_weights(data["prox"], data["behav"], data["mask"].to(mask_dtype), correction, cap)
    close(res.weights, w)
    assert res.mask.dtype == torch.bool and res.mask.tolist() == eff
    close(res.stats["is/truncated_frac"], trunc)
    close(res.stats["is/masked_frac"], masked)
    flat = [w[i][t] for i in range(len(w)) for t in range(len(w[0])) if eff[i][t]]
    close(res.stats["is/weight_mean"], sum(flat) / len(flat))
    close(res.stats["is/weight_max"], max(flat))
    close(res.stats["is/weight_min"], min(flat))
    close(res.stats["is/ess"], ref_ess(flat))
    if correction in ("tis", "seq_tis"):
        assert 0 < trunc < 1  # the data exercises both branches
    if correction in ("mis", "seq_mis"):
        assert 0 < masked < 1
    assert not res.weights.requires_grad and torch.isfinite(res.weights).all()
    assert not res.mask[0].any()  # the all-masked row stays out


def test_importance_weights_are_detached():
    data = make_batch(2)
    prox = data["prox"].clone().requires_grad_(True)
    res = alg.importance_weights(prox, data["behav"], data["mask"], "tis", 1.5)
    assert not res.weights.requires_grad


@pytest.mark.parametrize("correction", ["tis", "mis", "seq_tis", "seq_mis"])
def test_cap_exactly_hit_is_kept_untruncated(correction):
    """Ratios exactly equal to the cap (proximal == behaviour, cap 1.0) keep weight 1 and are not counted."""
    behav = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], dtype=torch.float64)
    prox = behav.clone()
    prox[1, 0] += 0.25  # this token (and its sequence) goes over the cap
    mask = torch.ones(2, 3, dtype=torch.bool)
    res = alg.importance_weights(prox, behav, mask, correction, cap=1.0)
    assert torch.equal(res.weights[0], torch.ones(3, dtype=torch.float64))
    assert res.mask[0].all()
    over = 1 / 6 if correction in ("tis", "mis") else 1 / 2
    key = "is/truncated_frac" if correction.endswith("tis") else "is/masked_frac"
    close(res.stats[key], over)
    if correction == "mis":
        assert res.mask[1].tolist() == [False, True, True] and res.weights[1, 0] == 0
    if correction == "seq_mis":
        assert not res.mask[1].any() and torch.all(res.weights[1] == 0)
    if correction == "tis":
        assert res.weights[1, 0] == 1.0
    if correction == "seq_tis":
        assert torch.all(res.weights[1] == 1.0)


def test_sequence_log_ratio_and_errors():
    data = make_batch(5)
    prox, behav, mask = rows(data["prox"]), rows(data["behav"]), rows(data["mask"])
    expected = []
    for i in range(len(mask)):
        diffs = [prox[i][t] - behav[i][t] for t in range(len(mask[0])) if mask[i][t]]
        expected.append(sum(diffs) / len(diffs) if diffs else 0.0)
    close(alg.sequence_log_ratio(data["prox"], data["behav"], data["mask"]), expected)
    with pytest.raises(ValueError, match="correction 'bogus'"):
        alg.importance_weights(data["prox"], data["behav"], data["mask"], "bogus")
    with pytest.raises(ValueError, match="is_cap=0"):
        alg.importance_weights(data["prox"], data["behav"], data["mask"], "tis", 0)


# ----------------------------------------------------------------------------------------------------------------
# losses


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_ppo_clip_loss_value_and_gradient(agg, token_adv):
    data = make_batch(6)
    cur = data["cur"].clone().requires_grad_(True)
    old = data["behav"].clone().requires_grad_(True)
    adv = data["adv"].clone()
    if token_adv:  # token-level advantages: vary along the sequence
        adv = adv[:, None] * torch.linspace(0.5, 1.5, cur.shape[1], dtype=torch.float64)[None, :]
    adv.requires_grad_(True)
    loss, stats = alg.ppo_clip_loss(cur, old, adv, data["mask"], 0.2, 0.28, agg)
    loss.backward()

    c, o, m, a = rows(data["cur"]), rows(data["behav"]), rows(data["mask"]), rows(adv)
    nb, nt = len(m), len(m[0])
    vals = [[0.0] * nt for _ in range(nb)]
    grads = [[0.0] * nt for _ in range(nb)]
    clip_active = n = 0
    for i in range(nb):
        for t in range(nt):
            if m[i][t]:
                a_it = a[i][t] if token_adv else a[i]
                vals[i][t], grads[i][t], lo, hi = ref_token_ppo(c[i][t], o[i][t], a_it, 0.2, 0.28)
                clip_active, n = clip_active + (lo or hi), n + 1
    ref_loss, ref_grad = ref_aggregate(vals, grads, m, agg)
    close(loss, ref_loss)
    close(cur.grad, ref_grad)
    close(stats["ppo/clip_frac"], clip_active / n)
    assert 0 < clip_active < n
    assert old.grad is None and adv.grad is None  # gradient flows only through current logprobs
    assert cur.grad[0].abs().sum() == 0 and torch.isfinite(cur.grad).all()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_decoupled_ppo_value_gradient_and_stats(correction, agg):
    data = make_batch(7)
    cap = CAPS[correction]
    cur = data["cur"].clone().requires_grad_(True)
    prox = data["prox"].clone().requires_grad_(True)
    behav = data["behav"].clone().requires_grad_(True)
    adv = data["adv"].clone().requires_grad_(True)
    loss, stats = alg.decoupled_ppo_loss(cur, prox, behav, adv, data["mask"], 0.2, 0.28, correction, cap, agg)
    loss.backward()
    ref_loss, ref_grad, ref_stats, _, _ = ref_decoupled(data, correction, cap, 0.2, 0.28, agg)
    close(loss, ref_loss)
    close(cur.grad, ref_grad)
    for key, value in ref_stats.items():
        close(stats[key], value)
    assert 0 < ref_stats["ppo/clip_frac"] < 1
    assert prox.grad is None and behav.grad is None and adv.grad is None
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_decoupled_gradient_equals_autograd_of_float64_reference(correction):
    """A second, independent reference: the loss built token by token from 0-d float64 tensors, then autograd."""
    data = make_batch(8, batch=6, seq=6)
    cap = CAPS[correction]
    w, eff, _, _ = ref_importance(rows(data["prox"]), rows(data["behav"]), rows(data["mask"]), correction, cap)
    cur_ref = data["cur"].clone().requires_grad_(True)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(len(eff)):
        for t in range(len(eff[0])):
            if eff[i][t]:
                r = torch.exp(cur_ref[i, t] - data["prox"][i, t])
                a = data["adv"][i]
                total = total - w[i][t] * torch.minimum(r * a, torch.clamp(r, 0.8, 1.28) * a)
                count += 1
    (total / count).backward()
    cur = data["cur"].clone().requires_grad_(True)
    loss, _ = alg.decoupled_ppo_loss(
        cur, data["prox"], data["behav"], data["adv"], data["mask"], 0.2, 0.28, correction, cap
    )
    loss.backward()
    close(loss, (total / count).item())
    close(cur.grad, rows(cur_ref.grad))


def test_decoupled_float32_inputs_close_to_float64_reference():
    data32 = make_batch(9, dtype=torch.float32)
    data64 = {k: (v.double() if v.is_floating_point() else v) for k, v in data32.items()}
    ref_loss, ref_grad, _, _, _ = ref_decoupled(data64, "tis", 1.5, 0.2, 0.28, "token_mean")
    cur = data32["cur"].clone().requires_grad_(True)
    loss, _ = alg.decoupled_ppo_loss(cur, data32["prox"], data32["behav"], data32["adv"], data32["mask"], is_cap=1.5)
    loss.backward()
    assert loss.dtype == torch.float32
    close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    close(cur.grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_decoupled_without_correction_on_policy_equals_ppo():
    data = make_batch(10)
    a, _ = alg.decoupled_ppo_loss(data["cur"], data["prox"], data["prox"], data["adv"], data["mask"], correction="tis")
    b, _ = alg.ppo_clip_loss(data["cur"], data["prox"], data["adv"], data["mask"])
    close(a, b.item())


def test_normalizer_replaces_denominator():
    data = make_batch(11)
    for agg in ("token_mean", "seq_mean"):
        cur = data["cur"].clone().requires_grad_(True)
        loss, _ = alg.decoupled_ppo_loss(
            cur,
            data["prox"],
            data["behav"],
            data["adv"],
            data["mask"],
            correction="mis",
            is_cap=1.5,
            agg=agg,
            normalizer=50.0,
        )
        loss.backward()
        ref_loss, ref_grad, _, _, _ = ref_decoupled(data, "mis", 1.5, 0.2, 0.28, agg, normalizer=50.0)
        close(loss, ref_loss)
        close(cur.grad, ref_grad)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_all_masked_batch_gives_zero_loss_and_gradient(correction, agg):
    data = make_batch(12)
    mask = torch.zeros_like(data["mask"])
    cur = data["cur"].clone().requires_grad_(True)
    loss, stats = alg.decoupled_ppo_loss(
        cur, data["prox"], data["behav"], data["adv"], mask, correction=correction, agg=agg
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.all(cur.grad == 0)
    assert all(torch.isfinite(v) for v in stats.values())


def test_seq_mis_dropping_a_whole_sequence_leaves_the_sequence_count():
    """seq_mean over the effective mask: a sequence masked out by seq_mis does not count as a 0 in the mean."""
    behav = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    prox = behav.clone()
    prox[2] += 1.0  # ratio e > cap: sequence 2 is dropped
    cur = (prox + 0.05).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 5.0], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.bool)
    loss, stats = alg.decoupled_ppo_loss(cur, prox, behav, adv, mask, correction="seq_mis", is_cap=2.0, agg="seq_mean")
    loss.backward()
    r = math.exp(0.05)
    close(loss, (-r * 1.0 + r * 2.0) / 2)  # two sequences in the mean, not three
    close(stats["is/masked_frac"], 1 / 3)
    close(cur.grad, [[-r / 4, -r / 4], [r / 2, r / 2], [0.0, 0.0]])


def test_large_log_ratio_stays_finite():
    cur = torch.tensor([[60.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    loss, _ = alg.ppo_clip_loss(cur, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(cur.grad).all()


# ----------------------------------------------------------------------------------------------------------------
# KL


def ref_kl(kind: str, cur: float, ref: float) -> tuple[float, float]:
    """Estimator value and its derivative in `cur`."""
    if kind == "k1":
        return cur - ref, 1.0
    if kind == "k2":
        return 0.5 * (cur - ref) ** 2, cur - ref
    return math.exp(ref - cur) - 1 - (ref - cur), 1 - math.exp(ref - cur)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_and_penalty(kind):
    data = make_batch(13)
    c, rf, m = rows(data["cur"]), rows(data["ref"]), rows(data["mask"])
    nb, nt = len(m), len(m[0])
    est = alg.kl_estimate(data["cur"], data["ref"], kind)
    for i in range(nb):
        for t in range(nt):
            if m[i][t]:
                close(est[i, t], ref_kl(kind, c[i][t], rf[i][t])[0])
    for agg in ("token_mean", "seq_mean"):
        cur = data["cur"].clone().requires_grad_(True)
        ref = data["ref"].clone().requires_grad_(True)
        term, stats = alg.kl_penalty(cur, ref, data["mask"], 0.05, kind, agg)
        term.backward()
        vals = [[ref_kl(kind, c[i][t], rf[i][t])[0] if m[i][t] else 0.0 for t in range(nt)] for i in range(nb)]
        grads = [[0.05 * ref_kl(kind, c[i][t], rf[i][t])[1] if m[i][t] else 0.0 for t in range(nt)] for i in range(nb)]
        ref_val, ref_grad = ref_aggregate(vals, grads, m, agg)
        close(term, 0.05 * ref_val)
        close(cur.grad, ref_grad)
        assert ref.grad is None
        flat = [vals[i][t] for i in range(nb) for t in range(nt) if m[i][t]]
        close(stats["kl/ref"], sum(flat) / len(flat))
    with pytest.raises(ValueError, match="KL estimator 'k4'"):
        alg.kl_estimate(data["cur"], data["ref"], "k4")


def test_k3_is_nonnegative_and_exact_near_zero():
    x = torch.tensor([-1.0, -1.0 + 1e-9, -3.0], dtype=torch.float64)
    y = torch.tensor([-1.0, -1.0, -0.5], dtype=torch.float64)
    k3 = alg.kl_k3(x, y)
    assert k3[0] == 0 and torch.all(k3 >= 0)
    close(k3[1], 0.5e-18, rtol=1e-6, atol=0)  # d^2/2 for small d


@pytest.mark.parametrize("kind", ["ppo", "decoupled_ppo"])
def test_policy_loss_dispatch_and_kl_term(kind):
    data = make_batch(14)
    kwargs = {"clip_low": 0.1, "clip_high": 0.3, "correction": "seq_tis", "is_cap": 1.1, "agg": "seq_mean"}
    base, _ = alg.policy_loss(kind, data["cur"], data["prox"], data["behav"], data["adv"], data["mask"], **kwargs)
    if kind == "ppo":
        direct, _ = alg.ppo_clip_loss(data["cur"], data["behav"], data["adv"], data["mask"], 0.1, 0.3, "seq_mean")
    else:
        ref_loss, _, _, _, _ = ref_decoupled(data, "seq_tis", 1.1, 0.1, 0.3, "seq_mean")
        direct = torch.tensor(ref_loss, dtype=torch.float64)
    close(base, direct.item())
    cur = data["cur"].clone().requires_grad_(True)
    total, stats = alg.policy_loss(
        kind,
        cur,
        data["prox"],
        data["behav"],
        data["adv"],
        data["mask"],
        ref_logprobs=data["ref"],
        kl_coef=0.1,
        **kwargs,
    )
    kl, _ = alg.kl_penalty(data["cur"], data["ref"], data["mask"], 0.1, "k3", "seq_mean")
    close(total, base.item() + kl.item())
    close(stats["loss/total"], total.item())
    close(stats["loss/policy"], base.item())
    total.backward()
    assert torch.isfinite(cur.grad).all()
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        alg.policy_loss(kind, cur, data["prox"], data["behav"], data["adv"], data["mask"], kl_coef=0.1)
    with pytest.raises(ValueError, match="policy loss 'grpo'"):
        alg.policy_loss("grpo", cur, data["prox"], data["behav"], data["adv"], data["mask"])


# ----------------------------------------------------------------------------------------------------------------
# metrics


def test_mismatch_metrics():
    data = make_batch(15)
    train, roll, m = rows(data["prox"]), rows(data["behav"]), rows(data["mask"])
    diffs = [train[i][t] - roll[i][t] for i in range(len(m)) for t in range(len(m[0])) if m[i][t]]
    got = alg.mismatch_metrics(data["prox"], data["behav"], data["mask"].float())
    close(got["mismatch/k3_kl"], sum(math.exp(d) - 1 - d for d in diffs) / len(diffs))
    close(got["mismatch/abs_diff_mean"], sum(abs(d) for d in diffs) / len(diffs))
    close(got["mismatch/abs_diff_max"], max(abs(d) for d in diffs))
    empty = alg.mismatch_metrics(data["prox"], data["behav"], torch.zeros_like(data["mask"]))
    assert all(v.item() == 0 for v in empty.values())


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


def test_masked_reductions_ignore_padding():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 2.0, -4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    close(alg.masked_sum(x, mask), 2.0)
    close(alg.masked_mean(x, mask), 0.5)
    close(alg.masked_mean(x, mask, dim=-1), [2.0, -1.0])
    close(alg.masked_max(x, mask), 3.0)
    close(alg.masked_min(x, mask), -4.0)
    close(alg.aggregate_loss(x, mask, "seq_mean"), 0.5)
    with pytest.raises(ValueError, match="loss aggregation 'sum'"):
        alg.aggregate_loss(x, mask, "sum")
