"""When the launcher's evaluations fall due (rollout/evaluation.py `Evaluator.due`): at each multiple of
`eval.interval` the trainer reaches, also when it passed the multiple between two looks, and at the last step."""

from __future__ import annotations

import types

from megatron_rl.rollout.evaluation import Evaluator


def _evaluator(interval: int) -> Evaluator:
    cfg = types.SimpleNamespace(interval=interval)
    return Evaluator({}, {}, [{"prompt_ids": [1], "answer": 1}], None, None, cfg, None)


def _looks(evaluator: Evaluator, versions: list[int], last_step: int) -> list[int]:
    """The versions evaluated when the launcher sees `versions` one look after another."""
    evaluated, last = [], None
    for version in versions:
        if evaluator.due(version, last, last_step):
            evaluated.append(version)
            last = version
    return evaluated


def test_each_multiple_reached_is_evaluated_once_even_when_passed_between_looks():
    evaluator = _evaluator(2)
    assert _looks(evaluator, [0, 1, 2, 2, 3, 4, 5, 6], last_step=6) == [2, 4, 6]
    assert _looks(evaluator, [0, 1, 3, 3, 5, 6], last_step=6) == [3, 5, 6]  # 2 and 4 passed between looks
    assert _looks(evaluator, [1, 4, 5], last_step=5) == [4, 5]  # 2 and 4 passed at once: one evaluation
    assert _looks(evaluator, [1, 3, 7, 9, 10], last_step=10) == [3, 7, 9, 10]


def test_no_interval_no_prompts_or_version_zero_is_never_due():
    assert _looks(_evaluator(0), [0, 1, 2, 3], last_step=3) == []
    assert _looks(_evaluator(1), [0], last_step=3) == []
    empty = _evaluator(1)
    empty.prompts = []
    assert _looks(empty, [1, 2, 3], last_step=3) == []
