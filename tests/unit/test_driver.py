"""The generation driver's pure parts: the reward-failure guard and the engine down/back bookkeeping."""

from __future__ import annotations

import pytest

from megatron_rl.config import load_config
from megatron_rl.rollout.driver import GenerationDriver, RewardError
from megatron_rl.rollout.types import Group, Sample


def _group(index: int, failed: bool) -> Group:
    sample = Sample(prompt_ids=[1], response_ids=[2], logprobs=[-0.5], versions=[0], prompt_index=index)
    if failed:
        sample.metadata["reward_error"] = f"reward 'my.fn' raised ZeroDivisionError at {index}"
    return Group(index, [sample])


def _driver(limit: int) -> GenerationDriver:
    cfg = load_config("configs/quickstart.yaml", [f"task.max_bad_reward_groups_in_a_row={limit}"])
    return GenerationDriver(buffer=None, engines={"engine-0": None}, task=None, tokenizer=None, cfg=cfg, lag=1)


def test_isolated_reward_failures_are_counted_and_the_run_goes_on():
    driver = _driver(limit=3)
    for index, failed in enumerate([True, True, False, True, True, False]):
        driver._check_rewards(_group(index, failed))
    assert driver.stats.bad_reward_groups == 4


def test_a_reward_that_always_fails_stops_the_run_with_its_error():
    driver = _driver(limit=3)
    driver._check_rewards(_group(0, True))
    driver._check_rewards(_group(1, True))
    with pytest.raises(RewardError, match=r"3 groups in a row.*prompt 2: reward 'my.fn' raised ZeroDivisionError"):
        driver._check_rewards(_group(2, True))


def test_a_dead_engine_gets_no_prompts_until_it_is_brought_back():
    driver = _driver(limit=3)
    driver.mark_down("engine-0", "ActorDiedError")
    driver.mark_down("engine-0", "a later report does not overwrite the first")
    assert driver.down == {"engine-0": "ActorDiedError"}
    replacement = object()
    driver.bring_back("engine-0", replacement)
    assert driver.down == {} and driver.engines["engine-0"] is replacement
    assert driver.stats.engine_restarts == 1
