"""algorithms/importance.py: every behaviour correction against a float64 reference written from the papers'
formulas (token TIS: Yao et al.; token MIS: ICEPOP / verl's token rejection; sequence IS on the product of token
ratios; geometric mean as verl's `geo`; the veto of whole sequences), on off-policy data with NaN padding and
log ratios far beyond the clamp."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from megatron_rl import algorithms as alg
from megatron_rl.config import ConfigError, load_config
from tests.unit.test_algorithms import clamp, close, make_batch, ref_ess, rows

CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis")
CAPS = {"none": 1.5, "tis": 1.5, "mis": 1.5, "seq_tis": 1.8, "seq_mis": 1.8, "geo_tis": 1.1, "geo_mis": 1.1}


def ref_correction(prox, behav, mask, correction, cap, cap_low=None, veto_max=None, veto_min=None):
    """Weights, kept mask, truncated / masked / vetoed fractions, from python floats.

    r_t = exp(clamp(prox_t - behav_t)), 1 where both logprobs are equal (also both -inf).
    """
    nb, nt = len(mask), len(mask[0])
    w = [[0.0] * nt for _ in range(nb)]
    keep = [[False] * nt for _ in range(nb)]
    is_mask = correction.endswith("mis")
    low = cap_low if cap_low is not None else (1.0 / cap if is_mask else 0.0)
    tokens = truncated = masked = seqs = vetoed = 0
    for i in range(nb):
        toks = [t for t in range(nt) if mask[i][t]]
        d = {t: 0.0 if prox[i][t] == behav[i][t] else prox[i][t] - behav[i][t] for t in toks}
        r = {t: math.exp(clamp(d[t])) for t in toks}
        tokens += len(toks)
        seqs += bool(toks)
        if correction == "none":
            for t in toks:
                w[i][t], keep[i][t] = 1.0, True
        elif correction in ("tis", "mis"):
            for t in toks:
                outside = r[t] > cap or r[t] < low
                if correction == "tis":
                    w[i][t], keep[i][t] = min(max(r[t], low), cap), True
                    truncated += outside
                elif not outside:
                    w[i][t], keep[i][t] = r[t], True
                else:
                    masked += 1
        elif toks:
            total = sum(d.values())
            big = math.exp(clamp(total if correction.startswith("seq") else total / len(toks)))
            outside = big > cap or big < low
            for t in toks:
                if correction.endswith("tis"):
                    w[i][t], keep[i][t] = min(max(big, low), cap), True
                elif not outside:
                    w[i][t], keep[i][t] = big, True
            truncated += correction.endswith("tis") and outside
            masked += is_mask and outside
        if any((veto_max is not None and r[t] > veto_max) or (veto_min is not None and r[t] < veto_min) for t in toks):
            vetoed += 1
            for t in toks:
                w[i][t], keep[i][t] = 0.0, False
    units = tokens if correction in ("none", "tis", "mis") else seqs
    return w, keep, truncated / max(units, 1), masked / max(units, 1), vetoed / max(seqs, 1)


def check(data, correction, cap, **kw):
    """Implementation vs reference: weights, kept mask, fractions and weight stats."""
    w, keep, trunc, masked, vetoed = ref_correction(
        rows(data["prox"]), rows(data["behav"]), rows(data["mask"]), correction, cap, **kw
    )
    res = alg.importance_weights(data["prox"], data["behav"], data["mask"], correction, cap, **kw)
    close(res.weights, w)
    assert res.mask.dtype == torch.bool and res.mask.tolist() == keep
    close(res.stats["is/truncated_frac"], trunc)
    close(res.stats["is/masked_frac"], masked)
    close(res.stats["is/vetoed_frac"], vetoed)
    flat = [w[i][t] for i in range(len(w)) for t in range(len(w[0])) if keep[i][t]]
    close(res.stats["is/weight_mean"], sum(flat) / len(flat))
    close(res.stats["is/weight_max"], max(flat))
    close(res.stats["is/weight_min"], min(flat))
    close(res.stats["is/ess"], ref_ess(flat))
    assert not res.weights.requires_grad and torch.isfinite(res.weights).all()
    assert not res.mask[0].any()  # the all-masked row stays out
    return trunc, masked, vetoed


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_corrections_match_reference(correction, mask_dtype):
    data = make_batch(1)
    data["mask"] = data["mask"].to(mask_dtype)
    trunc, masked, _ = check(data, correction, CAPS[correction])
    if correction.endswith("tis"):
        assert 0 < trunc < 1  # the data exercises both branches
    if correction.endswith("mis"):
        assert 0 < masked < 1


@pytest.mark.parametrize("correction", ["tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis"])
def test_corrections_with_a_lower_bound(correction):
    check(make_batch(2), correction, CAPS[correction], cap_low=0.7)


def test_masks_are_two_sided_by_default():
    """ICEPOP / verl token rejection: outside [1/C, C] is masked, below as well as above."""
    behav = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    prox = behav + torch.tensor([[0.0, math.log(2.5), math.log(0.3), math.log(0.6)]], dtype=torch.float64)
    res = alg.importance_weights(prox, behav, torch.ones(1, 4, dtype=torch.bool), "mis", 2.0)
    assert res.mask.tolist() == [[True, False, False, True]]
    close(res.stats["is/masked_frac"], 0.5)
    tis = alg.importance_weights(prox, behav, torch.ones(1, 4, dtype=torch.bool), "tis", 2.0)
    close(tis.weights, [[1.0, 2.0, 0.3, 0.6]])  # a truncation has no lower bound unless one is given


def test_sequence_is_is_the_product_and_geo_the_geometric_mean():
    behav = torch.zeros(2, 3, dtype=torch.float64)
    prox = torch.tensor([[0.2, 0.3, 0.1], [-0.4, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    seq = alg.importance_weights(prox, behav, mask, "seq_tis", 100.0)
    geo = alg.importance_weights(prox, behav, mask, "geo_tis", 100.0)
    close(seq.weights[:, 0], [math.exp(0.6), math.exp(-0.3)])
    close(geo.weights[:, 0], [math.exp(0.2), math.exp(-0.15)])
    close(alg.sequence_log_ratio(prox, behav, mask), [0.6, -0.3])
    close(alg.geometric_log_ratio(prox, behav, mask), [0.2, -0.15])


@pytest.mark.parametrize("correction", ["none", "tis", "mis", "seq_tis", "geo_mis"])
def test_veto_by_the_largest_and_smallest_token_ratio(correction):
    data = make_batch(3)
    _, _, vetoed = check(data, correction, CAPS[correction], veto_max=3.0)
    assert 0 < vetoed < 1
    _, _, vetoed = check(data, correction, CAPS[correction], veto_max=3.0, veto_min=0.4)
    assert 0 < vetoed < 1


def test_both_logprobs_minus_infinity_give_ratio_one():
    inf = float("-inf")
    prox = torch.tensor([[inf, -1.0, inf]], dtype=torch.float64)
    behav = torch.tensor([[inf, -1.5, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    close(alg.token_log_ratio(prox, behav, mask), [[0.0, 0.5, -math.inf]])
    for correction in CORRECTIONS:
        res = alg.importance_weights(prox, behav, mask, correction, 2.0)
        assert not torch.isnan(res.weights).any(), correction
    close(alg.importance_weights(prox, behav, mask, "tis", 2.0).weights, [[1.0, math.exp(0.5), math.exp(-20.0)]])


@pytest.mark.parametrize("correction", ["tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis"])
def test_cap_exactly_hit_is_kept_untruncated(correction):
    """Ratios exactly equal to the cap (proximal == behaviour, cap 1.0) keep weight 1 and are not counted."""
    behav = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], dtype=torch.float64)
    prox = behav.clone()
    prox[1, 0] += 0.25  # this token (and its sequence) goes over the cap
    mask = torch.ones(2, 3, dtype=torch.bool)
    res = alg.importance_weights(prox, behav, mask, correction, cap=1.0)
    assert torch.equal(res.weights[0], torch.ones(3, dtype=torch.float64)) and res.mask[0].all()
    over = 1 / 6 if correction in ("tis", "mis") else 1 / 2
    close(res.stats["is/truncated_frac" if correction.endswith("tis") else "is/masked_frac"], over)


def test_errors_are_named():
    data = make_batch(5)
    with pytest.raises(ValueError, match="correction 'bogus'"):
        alg.importance_weights(data["prox"], data["behav"], data["mask"], "bogus")
    with pytest.raises(ValueError, match="is_cap=0"):
        alg.importance_weights(data["prox"], data["behav"], data["mask"], "tis", 0)
    with pytest.raises(ValueError, match="is_cap_low=3"):
        alg.importance_weights(data["prox"], data["behav"], data["mask"], "mis", 2.0, cap_low=3.0)
    prox = data["prox"].clone().requires_grad_(True)
    assert not alg.importance_weights(prox, data["behav"], data["mask"], "tis", 1.5).weights.requires_grad


# ----------------------------------------------------------------------------------------------------------------
# the config: seq_tis / seq_mis changed meaning


@pytest.mark.parametrize("old", ["seq_tis", "seq_mis"])
def test_a_config_saved_before_seq_is_changed_meaning_fails_at_load(tmp_path, old):
    saved = {"advantage": "grpo", "loss": "decoupled_ppo", "clip_low": 0.2, "clip_high": 0.28, "correction": old,
             "is_cap": 2.0, "kl_coef": 0.0, "loss_agg": "token_mean"}  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"algorithm": saved}))
    new = "geo_" + old.split("_")[1]
    with pytest.raises(ConfigError, match=rf"{old}.*product of token ratios.*former behaviour.*is {new}"):
        load_config(path)
    assert load_config(path, [f"algorithm.correction={new}"]).algorithm.correction == new
    assert load_config(path, ["algorithm.is_normalizer=all"]).algorithm.correction == old  # a newer config
    assert load_config(None, [f"algorithm.correction={old}"]).algorithm.correction == old
