"""algorithms/losses.py and objective.py: PPO (asymmetric and dual clip), decoupled PPO (AReaL), GSPO, CISPO, Dr.
GRPO and the whole objective (normalisers, KL term, entropy bonus), value and gradient against float64 references
written from the papers' formulas, on off-policy data with NaN padding and extreme ratios."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl import algorithms as alg
from megatron_rl.algorithms.objective import LossSpec
from tests.unit.test_algorithms import AGGS, NORM_TOKENS, clamp, close, make_batch, ref_aggregate, ref_grpo, rows
from tests.unit.test_corrections import CAPS, CORRECTIONS, ref_correction
from tests.unit.test_kl import ref_kl

# ----------------------------------------------------------------------------------------------------------------
# references


def ref_clip(r: float, adv: float, low: float, high: float, dual: float | None, clamped: bool):
    """PPO's -min(rA, clip(r)A) (dual clip: where A < 0, at most -cA): loss, d loss / d log r, flags."""
    unclipped, clipped = r * adv, min(max(r, 1 - low), 1 + high) * adv
    objective, grad = (unclipped, adv * r) if unclipped <= clipped else (clipped, 0.0)
    dual_active = dual is not None and adv < 0 and dual * adv > objective
    if dual_active:
        objective, grad = dual * adv, 0.0
    flags = (adv < 0 and r < 1 - low, adv > 0 and r > 1 + high, dual_active)
    return -objective, (0.0 if clamped else -grad), flags


def ref_surrogates(kind, cur, anchor, adv, mask, low, high, dual):
    """Per-token loss, derivative in `cur`, ratio and flags of `ppo`-like losses, GSPO or CISPO."""
    nb, nt = len(mask), len(mask[0])
    vals, grads = [[0.0] * nt for _ in range(nb)], [[0.0] * nt for _ in range(nb)]
    ratios, flags = {}, {}
    for i in range(nb):
        toks = [t for t in range(nt) if mask[i][t]]
        seq = sum(cur[i][t] - anchor[i][t] for t in toks) / max(len(toks), 1)
        for t in toks:
            d = seq if kind == "gspo" else cur[i][t] - anchor[i][t]
            r = math.exp(clamp(d))
            ratios[i, t] = r
            if kind == "cispo":
                w = min(max(r, 1 - low), 1 + high)
                vals[i][t], grads[i][t] = -w * adv[i] * cur[i][t], -w * adv[i]
                flags[i, t] = (r < 1 - low, r > 1 + high, False)
                continue
            vals[i][t], grads[i][t], flags[i, t] = ref_clip(r, adv[i], low, high, dual, abs(d) > 20)
    return vals, grads, ratios, flags


def ref_objective(data, spec: LossSpec, entropy=None, normalizer=None):
    """The whole objective's value, gradient in `cur` and stats, from python floats."""
    cur, prox, behav, mask = rows(data["cur"]), rows(data["prox"]), rows(data["behav"]), rows(data["mask"])
    adv = rows(data["adv"])
    if spec.kind == "ppo":
        anchor, (w, keep, trunc, masked, vetoed) = behav, ref_correction(prox, behav, mask, "none", 1.0)
    else:
        anchor = prox
        w, keep, trunc, masked, vetoed = ref_correction(
            prox, behav, mask, spec.correction, spec.is_cap, spec.is_cap_low, spec.veto_max, spec.veto_min
        )
    low, high = (spec.gspo_clip_low, spec.gspo_clip_high) if spec.kind == "gspo" else (spec.clip_low, spec.clip_high)
    vals, grads, ratios, flags = ref_surrogates(spec.kind, cur, anchor, adv, mask, low, high, spec.dual_clip)
    nb, nt = len(mask), len(mask[0])
    wv = [[w[i][t] * vals[i][t] if keep[i][t] else 0.0 for t in range(nt)] for i in range(nb)]
    wg = [[w[i][t] * grads[i][t] if keep[i][t] else 0.0 for t in range(nt)] for i in range(nb)]
    agg_mask = keep if spec.is_normalizer == "kept" else mask
    loss, dloss = ref_aggregate(wv, wg, agg_mask, spec.agg, normalizer, spec.norm_tokens or NORM_TOKENS)
    if spec.kl_coef > 0:
        ref = rows(data["ref"])
        kv = [
            [ref_kl(spec.kl_kind, cur[i][t], ref[i][t])[0] if mask[i][t] else 0.0 for t in range(nt)] for i in range(nb)
        ]
        kg = [
            [ref_kl(spec.kl_kind, cur[i][t], ref[i][t])[1] if mask[i][t] else 0.0 for t in range(nt)] for i in range(nb)
        ]
        kl_loss, kl_grad = ref_aggregate(kv, kg, mask, spec.agg, None, spec.norm_tokens or NORM_TOKENS)
        loss += spec.kl_coef * kl_loss
        dloss = [[dloss[i][t] + spec.kl_coef * kl_grad[i][t] for t in range(nt)] for i in range(nb)]
    ent_grad = None
    if entropy is not None and spec.entropy_coef > 0:
        ones = [[1.0] * nt for _ in range(nb)]
        bonus, ent_grad = ref_aggregate(entropy, ones, mask, spec.agg, None, spec.norm_tokens or NORM_TOKENS)
        loss -= spec.entropy_coef * bonus
        ent_grad = [[-spec.entropy_coef * g for g in row] for row in ent_grad]
    kept = [(i, t) for i in range(nb) for t in range(nt) if keep[i][t]]
    n = max(len(kept), 1)
    r = [ratios[k] for k in kept]
    stats = {
        "ppo/clip_frac": sum(flags[k][0] or flags[k][1] for k in kept) / n,
        "ppo/clip_frac_low": sum(flags[k][0] for k in kept) / n,
        "ppo/clip_frac_high": sum(flags[k][1] for k in kept) / n,
        "ppo/dual_clip_frac": sum(flags[k][2] for k in kept) / n,
        "ppo/ratio_mean": sum(r) / n,
        "ppo/ratio_max": max(r),
        "ppo/ratio_min": min(r),
        "ppo/approx_kl": sum(x - 1 - math.log(x) for x in r) / n,
        "ppo/tokens": float(len(kept)),
        "is/truncated_frac": trunc,
        "is/masked_frac": masked,
        "is/vetoed_frac": vetoed,
    }
    return loss, dloss, stats, ent_grad


def run(data, spec: LossSpec, entropy=None, normalizer=None, input_normalizer=None):
    """The implementation's loss, gradient in `cur` (and in `entropy`) and stats."""
    cur = data["cur"].clone().requires_grad_(True)
    frozen = {k: data[k].clone().requires_grad_(True) for k in ("prox", "behav", "adv", "ref")}
    ent = None if entropy is None else torch.tensor(entropy, dtype=torch.float64, requires_grad=True)
    loss, stats = alg.policy_loss(
        spec, cur, frozen["prox"], frozen["behav"], frozen["adv"], data["mask"], normalizer=normalizer,
        input_normalizer=input_normalizer, ref_logprobs=frozen["ref"], entropy=ent,
    )  # fmt: skip
    loss.backward()
    assert all(t.grad is None for t in frozen.values())  # gradient flows only through the current logprobs
    assert torch.isfinite(cur.grad).all() and cur.grad[0].abs().sum() == 0
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())
    return loss, cur.grad, stats, None if ent is None else ent.grad


def check(data, spec: LossSpec, **kw):
    loss, grad, stats, _ = run(data, spec, **kw)
    ref_loss, ref_grad, ref_stats, _ = ref_objective(data, spec, normalizer=kw.get("normalizer"))
    close(loss, ref_loss)
    close(grad, ref_grad)
    for key, value in ref_stats.items():
        close(stats[key], value)
    return ref_stats


# ----------------------------------------------------------------------------------------------------------------
# the objectives


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_against_the_behaviour_policy(agg, dual):
    spec = LossSpec(kind="ppo", agg=agg, dual_clip=dual, norm_tokens=NORM_TOKENS)
    stats = check(make_batch(6), spec)
    assert 0 < stats["ppo/clip_frac"] < 1


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_decoupled_ppo_with_every_correction(correction, agg):
    spec = LossSpec(
        kind="decoupled_ppo", correction=correction, is_cap=CAPS[correction], agg=agg, norm_tokens=NORM_TOKENS
    )
    stats = check(make_batch(7), spec)
    assert 0 < stats["ppo/clip_frac"] < 1


@pytest.mark.parametrize("normalizer", ["all", "kept"])
@pytest.mark.parametrize("correction", ["mis", "seq_mis", "geo_mis"])
def test_masking_corrections_with_either_normaliser(correction, normalizer):
    spec = LossSpec(
        correction=correction, is_cap=CAPS[correction], is_normalizer=normalizer, veto_max=20.0, is_cap_low=0.5
    )
    stats = check(make_batch(8), spec)
    assert stats["is/masked_frac"] > 0 and stats["is/vetoed_frac"] > 0


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("correction", ["none", "tis", "seq_tis"])
def test_gspo(correction, agg):
    spec = LossSpec(kind="gspo", correction=correction, is_cap=CAPS[correction], agg=agg, norm_tokens=NORM_TOKENS,
                    gspo_clip_low=0.05, gspo_clip_high=0.08)  # fmt: skip
    stats = check(make_batch(9), spec)
    assert 0 < stats["ppo/clip_frac"] < 1


def test_gspo_token_gradient_is_the_sequence_objectives_gradient():
    """GSPO (Zheng et al. 2025): J = 1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = (pi/pi_old)^(1/|y_i|); its
    gradient by autograd on 0-d tensors equals the GSPO-token loss's under seq_mean."""
    data = make_batch(10, extreme=False)
    cur_ref = data["cur"].clone().requires_grad_(True)
    m = rows(data["mask"])
    total, groups = torch.zeros((), dtype=torch.float64), 0
    for i in range(len(m)):
        toks = [t for t in range(len(m[0])) if m[i][t]]
        if not toks:
            continue
        s = torch.exp(sum(cur_ref[i, t] - data["prox"][i, t] for t in toks) / len(toks))
        a = data["adv"][i]
        total, groups = total - torch.minimum(s * a, s.clamp(1 - 0.05, 1 + 0.08) * a), groups + 1
    (total / groups).backward()
    spec = LossSpec(
        kind="gspo", correction="none", agg="seq_mean", dual_clip=None, gspo_clip_low=0.05, gspo_clip_high=0.08
    )
    loss, grad, stats, _ = run(data, spec)
    close(loss, (total / groups).item())
    close(grad, rows(cur_ref.grad))
    assert 0 < stats["ppo/clip_frac"] < 1


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_cispo(correction, agg):
    spec = LossSpec(kind="cispo", correction=correction, is_cap=CAPS[correction], agg=agg, norm_tokens=NORM_TOKENS)
    stats = check(make_batch(11), spec)
    assert 0 < stats["ppo/clip_frac"] < 1


def test_cispo_never_stops_a_tokens_gradient():
    """MiniMax-M1's point: a token with a clipped weight still gets -clip(r) A as gradient (PPO gives it 0)."""
    cur = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    anchor = torch.tensor([[-1.0]], dtype=torch.float64)  # r = e > 1 + clip_high
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    loss, _ = alg.policy_loss(LossSpec(kind="cispo", correction="none"), cur, anchor, anchor, adv, mask)
    loss.backward()
    close(cur.grad, [[-1.28]])
    cur.grad = None
    loss, _ = alg.policy_loss(LossSpec(kind="decoupled_ppo", correction="none"), cur, anchor, anchor, adv, mask)
    loss.backward()
    close(cur.grad, [[0.0]])


def test_dr_grpo_objective():
    """Dr. GRPO (Liu et al. 2025): A = r - mean(group) (no std), loss = -sum_i sum_t min(r A, clip(r) A) / (G L)."""
    data = make_batch(12, extreme=False)
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    ids = torch.arange(12) // 4
    data["adv"] = alg.compute_advantages("grpo_no_std", rewards, group_ids=ids)
    close(data["adv"], ref_grpo(rows(rewards), ids.tolist(), normalize_std=False))
    spec = LossSpec(correction="none", agg="seq_mean_token_sum_norm", norm_tokens=16, dual_clip=None)
    loss, _, _, _ = run(data, spec)
    cur, prox, m, adv = rows(data["cur"]), rows(data["prox"]), rows(data["mask"]), rows(data["adv"])
    total = 0.0
    for i in range(12):
        for t in range(len(m[0])):
            if m[i][t]:
                r = math.exp(cur[i][t] - prox[i][t])
                total += min(r * adv[i], min(max(r, 0.8), 1.28) * adv[i])
    close(loss, -total / (12 * 16))


def test_dual_clip_bounds_a_wild_negative_token():
    """Under plain PPO one token at A < 0 with a ratio of exp(20) cost 4.85e8; the dual clip caps it at 3 |A|."""
    cur = torch.tensor([[40.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2)
    loss, stats = alg.policy_loss(LossSpec(kind="ppo", dual_clip=None), cur, None, old, adv, mask)
    close(loss, (math.exp(20) + 1) / 2)
    loss, stats = alg.policy_loss(LossSpec(kind="ppo"), cur, None, old, adv, mask)
    loss.backward()
    close(loss, (3.0 + 1.0) / 2)
    close(stats["ppo/dual_clip_frac"], 0.5)
    assert torch.isfinite(cur.grad).all() and cur.grad[0, 0] == 0


# ----------------------------------------------------------------------------------------------------------------
# the whole objective


@pytest.mark.parametrize("kl_kind", ["k1", "k2", "k3", "k3+"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_kl_term_and_entropy_bonus(kl_kind, agg):
    data = make_batch(13)
    g = torch.Generator().manual_seed(13)
    entropy = rows(torch.rand(data["cur"].shape, generator=g, dtype=torch.float64) * 2)
    spec = LossSpec(correction="tis", agg=agg, kl_coef=0.1, kl_kind=kl_kind, entropy_coef=0.01)
    loss, grad, stats, ent_grad = run(data, spec, entropy=entropy)
    ref_loss, ref_grad, _, ref_ent_grad = ref_objective(data, spec, entropy=entropy)
    close(loss, ref_loss)
    close(grad, ref_grad)
    close(ent_grad, ref_ent_grad)
    m = rows(data["mask"])
    flat = [entropy[i][t] for i in range(len(m)) for t in range(len(m[0])) if m[i][t]]
    close(stats["policy/entropy"], sum(flat) / len(flat))
    close(stats["loss/total"], loss.item())


def test_global_normalizers_replace_the_denominators():
    data = make_batch(14)
    spec = LossSpec(correction="mis", is_cap=1.5, is_normalizer="kept")
    loss, grad, _, _ = run(data, spec, normalizer=50.0, input_normalizer=70.0)
    ref_loss, ref_grad, _, _ = ref_objective(data, spec, normalizer=50.0)
    close(loss, ref_loss)
    close(grad, ref_grad)


def test_float32_inputs_close_to_the_float64_reference():
    data32 = make_batch(15, dtype=torch.float32)
    data64 = {k: (v.double() if v.is_floating_point() else v) for k, v in data32.items()}
    spec = LossSpec(correction="tis", is_cap=1.5)
    ref_loss, ref_grad, _, _ = ref_objective(data64, spec)
    loss, grad, _, _ = run(data32, spec)
    assert loss.dtype == torch.float32
    close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["ppo", "decoupled_ppo", "gspo", "cispo"])
@pytest.mark.parametrize("agg", AGGS)
def test_all_masked_batch_gives_zero_loss_and_gradient(kind, agg):
    data = make_batch(16)
    data["mask"] = torch.zeros_like(data["mask"])
    cur = data["cur"].clone().requires_grad_(True)
    spec = LossSpec(kind=kind, agg=agg, norm_tokens=NORM_TOKENS, kl_coef=0.1)
    loss, stats = alg.policy_loss(
        spec, cur, data["prox"], data["behav"], data["adv"], data["mask"], ref_logprobs=data["ref"]
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.all(cur.grad == 0)
    assert all(torch.isfinite(v) for v in stats.values())


def test_denominators_follow_the_normaliser():
    data = make_batch(17)
    kept = alg.importance_weights(data["prox"], data["behav"], data["mask"], "mis", 1.5).mask
    counts = alg.denominators(
        LossSpec(correction="mis", is_cap=1.5, is_normalizer="kept"), data["prox"], data["behav"], data["mask"]
    )
    assert counts.tolist() == [float(kept.sum()), float(data["mask"].sum())]
    counts = alg.denominators(LossSpec(correction="mis", is_cap=1.5), data["prox"], data["behav"], data["mask"])
    assert counts.tolist() == [float(data["mask"].sum())] * 2


def test_errors_are_named():
    data = make_batch(18)
    args = (data["cur"], None, data["behav"], data["adv"], data["mask"])
    with pytest.raises(ValueError, match="decoupled_ppo needs proximal_logprobs"):
        alg.policy_loss(LossSpec(), *args)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        alg.policy_loss(LossSpec(kind="ppo", kl_coef=0.1), *args)
    with pytest.raises(ValueError, match="policy loss 'grpo'"):
        alg.policy_loss(LossSpec(kind="grpo"), data["cur"], data["prox"], *args[2:])
    with pytest.raises(ValueError, match="dual_clip=1"):
        alg.policy_loss(LossSpec(kind="ppo", dual_clip=1.0), *args)
