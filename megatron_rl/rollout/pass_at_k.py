"""Evaluation scores of several samples per prompt: the unbiased pass@k estimator and mean@k.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n samples of a prompt of
which c pass, the chance that at least one of k samples drawn without replacement passes is
1 - C(n - c, k) / C(n, k); averaged over prompts. mean@k: the mean reward of the first k samples, averaged over
prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k for one prompt with `n` samples, `c` of them passing (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i): the stable form of 1 - C(n-c, k) / C(n, k)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, the powers of 2 below n, and n."""
    ks = {1, n}
    k = 2
    while k < n:
        ks.add(k)
        k *= 2
    return sorted(ks)


def eval_scores(rewards: Sequence[Sequence[float]], threshold: float, prefix: str = "eval/") -> dict[str, float]:
    """`pass@k` (a sample passes when its reward is at least `threshold`) and `mean@k` for every k of `ks_for`,
    from each prompt's sample rewards (every prompt the same number of samples)."""
    if not rewards:
        return {}
    n = len(rewards[0])
    if n == 0 or any(len(r) != n for r in rewards):
        raise ValueError(
            f"every prompt needs the same number (>= 1) of samples, got {sorted({len(r) for r in rewards})}"
        )
    out = {}
    for k in ks_for(n):
        passed = [pass_at_k(n, sum(r >= threshold for r in row), k) for row in rewards]
        out[f"{prefix}pass@{k}"] = sum(passed) / len(passed)
        out[f"{prefix}mean@{k}"] = sum(sum(row[:k]) / k for row in rewards) / len(rewards)
    return out
