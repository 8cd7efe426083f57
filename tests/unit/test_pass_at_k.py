"""pass@k is the unbiased estimator: equal to a brute-force count over every k-subset of the samples."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_rl.rollout.pass_at_k import eval_scores, ks_for, pass_at_k


def brute_force(passes: list[bool], k: int) -> float:
    """The share of all k-subsets of the samples that hold at least one passing sample."""
    subsets = list(itertools.combinations(range(len(passes)), k))
    return sum(any(passes[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_a_brute_force_count(n):
    rng = random.Random(n)
    for _ in range(20):
        passes = [rng.random() < 0.4 for _ in range(n)]
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(passes), k) == pytest.approx(brute_force(passes, k), abs=1e-12)


def test_eval_scores_average_over_prompts():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.5, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    scores = eval_scores(rewards, threshold=1.0)
    assert ks_for(4) == [1, 2, 4]
    assert scores["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert scores["eval/pass@4"] == pytest.approx(2 / 3)
    assert scores["eval/pass@2"] == pytest.approx((brute_force([1, 0, 0, 0], 2) + brute_force([0, 1, 1, 0], 2)) / 3)
    assert scores["eval/mean@1"] == pytest.approx(1.5 / 3)
    assert scores["eval/mean@4"] == pytest.approx((0.25 + 0.625 + 0) / 3)
    with pytest.raises(ValueError, match="same number"):
        eval_scores([[1.0], [1.0, 0.0]], threshold=1.0)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)
