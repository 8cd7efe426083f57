"""algorithms/kl.py: Schulman's k1/k2/k3 estimators (k3 clamped as verl), `k3+` (k3's value, k2's gradient), the
KL loss term and the KL reward penalty, against float64 references; finite for log ratios up to +-100; and the
expected gradients each estimator gives as a loss, computed exactly on a small categorical policy."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl import algorithms as alg
from tests.unit.test_algorithms import clamp, close, make_batch, ref_aggregate, rows


def ref_kl(kind: str, cur: float, ref: float) -> tuple[float, float]:
    """Estimator value and its derivative in `cur` (d = ref - cur; k3 clamps d to +-20, the value to +-10)."""
    if kind == "k1":
        return cur - ref, 1.0
    if kind == "k2":
        return 0.5 * (cur - ref) ** 2, cur - ref
    d = clamp(ref - cur)
    raw = math.exp(d) - 1 - d
    value = max(-10.0, min(10.0, raw))
    if kind == "k3+":
        return value, cur - ref
    inside = abs(ref - cur) < 20 and abs(raw) < 10
    return value, (1 - math.exp(d)) if inside else 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_estimators_and_penalty(kind):
    data = make_batch(13)
    c, rf, m = rows(data["cur"]), rows(data["ref"]), rows(data["mask"])
    nb, nt = len(m), len(m[0])
    est = alg.kl_estimate(data["cur"], data["ref"], kind)
    for i in range(nb):
        for t in range(nt):
            if m[i][t]:
                close(est[i, t], ref_kl(kind, c[i][t], rf[i][t])[0])
    for agg in ("token_mean", "seq_mean", "seq_mean_token_sum"):
        cur = data["cur"].clone().requires_grad_(True)
        ref = data["ref"].clone().requires_grad_(True)
        term, stats = alg.kl_penalty(cur, ref, data["mask"], 0.05, kind, agg)
        term.backward()
        vals = [[ref_kl(kind, c[i][t], rf[i][t])[0] if m[i][t] else 0.0 for t in range(nt)] for i in range(nb)]
        grads = [[0.05 * ref_kl(kind, c[i][t], rf[i][t])[1] if m[i][t] else 0.0 for t in range(nt)] for i in range(nb)]
        ref_val, ref_grad = ref_aggregate(vals, grads, m, agg)
        close(term, 0.05 * ref_val)
        close(cur.grad, ref_grad)
        assert ref.grad is None and torch.isfinite(cur.grad).all()
        flat = [vals[i][t] for i in range(nb) for t in range(nt) if m[i][t]]
        close(stats["kl/ref"], sum(flat) / len(flat))
    with pytest.raises(ValueError, match="KL estimator 'k4'"):
        alg.kl_estimate(data["cur"], data["ref"], "k4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_stays_finite_for_log_ratios_up_to_100(dtype):
    """Without the clamps k3 at logprob -30 or -100 against a reference of -0.01 is 1.06e13 and inf (fp32)."""
    cur = torch.tensor([-30.0, -100.0, -0.01, 50.0, -0.01], dtype=dtype, requires_grad=True)
    ref = torch.tensor([-0.01, -0.01, -100.0, -50.0, -0.01], dtype=dtype)
    for kind in ("k1", "k2", "k3", "k3+"):
        value = alg.kl_estimate(cur, ref, kind)
        value.sum().backward()
        assert torch.isfinite(value).all() and torch.isfinite(cur.grad).all(), kind
        if kind == "k3":
            close(value[:2], [10.0, 10.0])
            close(value[4], 0.0)
        cur.grad = None


def test_k3_is_nonnegative_and_exact_near_zero():
    x = torch.tensor([-1.0, -1.0 + 1e-9, -3.0], dtype=torch.float64)
    y = torch.tensor([-1.0, -1.0, -0.5], dtype=torch.float64)
    k3 = alg.kl_k3(x, y)
    assert k3[0] == 0 and torch.all(k3 >= 0)
    close(k3[1], 0.5e-18, rtol=1e-6, atol=0)  # d^2/2 for small d


def test_expected_gradients_as_losses():
    """On-policy, E_{y~pi}[grad k(y)]: k2 and k3+ give grad KL(pi || ref), k3 gives grad KL(ref || pi) (the
    forward KL), k1 gives 0; exact sums over a 6-token vocabulary, gradients by autograd in float64."""
    g = torch.Generator().manual_seed(3)
    theta0 = torch.randn(6, generator=g, dtype=torch.float64) * 0.4  # small: k3 stays inside its clamps
    ref_logp = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64) * 0.4, -1)

    def grad_of(fn):
        theta = theta0.clone().requires_grad_(True)
        fn(theta).backward()
        return theta.grad

    def expected(kind):
        def loss(theta):
            logp = torch.log_softmax(theta, -1)
            p = logp.exp().detach()  # the sampling distribution carries no gradient
            return (p * alg.kl_estimate(logp, ref_logp, kind)).sum()

        return grad_of(loss)

    reverse = grad_of(lambda t: (torch.softmax(t, -1) * (torch.log_softmax(t, -1) - ref_logp)).sum())
    forward = grad_of(lambda t: (ref_logp.exp() * (ref_logp - torch.log_softmax(t, -1))).sum())
    close(expected("k2"), rows(reverse), rtol=1e-9, atol=1e-12)
    close(expected("k3+"), rows(reverse), rtol=1e-9, atol=1e-12)
    close(expected("k3"), rows(forward), rtol=1e-9, atol=1e-12)
    close(expected("k1"), [0.0] * 6, atol=1e-12)
    assert float((reverse - forward).abs().max()) > 1e-3  # the two are different directions


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_sequence_kl_for_the_reward(kind):
    data = make_batch(19)
    c, rf, m = rows(data["cur"]), rows(data["ref"]), rows(data["mask"])
    expected = [sum(ref_kl(kind, c[i][t], rf[i][t])[0] for t in range(len(m[0])) if m[i][t]) for i in range(len(m))]
    got = alg.sequence_kl(data["cur"].requires_grad_(True), data["ref"], data["mask"], kind)
    close(got, expected)
    assert not got.requires_grad
