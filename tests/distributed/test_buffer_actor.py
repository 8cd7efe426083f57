"""The rollout buffer as a real (threaded) Ray actor: two concurrent producer tasks and a consumer; the
accounting identity holds at the end and every prompt is consumed or dropped exactly once, also when dynamic
sampling drops the half of the groups whose rewards are all equal."""

from __future__ import annotations

import random

import pytest

ray = pytest.importorskip("ray")

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.launcher import start_buffer  # noqa: E402
from megatron_rl.rollout.buffer import make_buffer_actor  # noqa: E402
from megatron_rl.rollout.tasks import PromptStream, Task  # noqa: E402
from megatron_rl.rollout.types import Group, Sample  # noqa: E402
from megatron_rl.run_state import ResumeError  # noqa: E402

PROMPTS = 120


class NumberTask(Task):
    """PROMPTS prompts, one epoch."""

    name = "numbers"

    def prompts(self, epoch=0, start=0):
        for index in range(start, PROMPTS):
            yield {"prompt": str(index), "prompt_ids": [3, index], "answer": index}

    def reward(self, response, answer, sample=None):
        return 1.0


@ray.remote(num_cpus=0)
def produce(buffer, seed: int, flat_even: bool = False) -> dict:
    """A generation driver: claims prompts, sometimes 'loses an engine' (requeue), else delivers a group tagged
    with the buffer's current trainer version; some rewards fail (NaN). With `flat_even` the groups of even
    prompts have two samples with equal rewards, the others two different ones."""
    rng = random.Random(seed)
    delivered = requeued = 0
    while not ray.get(buffer.stats.remote())["finished"]:
        claimed = ray.get(buffer.claim_prompts.remote(rng.randint(1, 4), timeout_s=0.2))
        version = ray.get(buffer.stats.remote())["trainer_version"]
        for index, record in claimed:
            if rng.random() < 0.1:
                requeued += ray.get(buffer.requeue.remote(index, f"producer {seed}: engine died"))
                continue
            reward = float("nan") if rng.random() < 0.05 else rng.random()
            versions = [max(0, version - rng.randint(0, 2))] * 2
            rewards = [reward] if not flat_even else [reward, reward if index % 2 == 0 else reward + 1.0]
            samples = [
                Sample(record["prompt_ids"], [5, 6], [-0.1, -0.2], versions, r, prompt_index=index) for r in rewards
            ]
            ray.get(buffer.put_group.remote(Group(index, samples)))
            delivered += 1
    return {"delivered": delivered, "requeued": requeued}


def test_buffer_actor_with_two_producers_and_a_consumer(local_ray):
    buffer = make_buffer_actor(
        capacity=8, max_staleness=1, stale_policy="drop", prompts=PromptStream(NumberTask(), epochs=1)
    )
    producers = [produce.remote(buffer, seed) for seed in (1, 2)]
    consumed: list[int] = []
    version = 0
    while True:
        batch = ray.get(buffer.get_batch.remote(4, version, timeout_s=0.5, allow_partial=True), timeout=60)
        consumed += [g.prompt_index for g in batch]
        version += 1 if batch else 0
        if not batch and ray.get(buffer.stats.remote())["finished"]:
            break
    results = ray.get(producers, timeout=60)
    counts = ray.get(buffer.check_accounting.remote())
    stats = ray.get(buffer.stats.remote())
    assert counts["drawn"] == PROMPTS
    assert counts["in_flight"] == counts["buffered"] == counts["retry_pending"] == 0
    assert counts["produced"] == counts["consumed"] + counts["dropped"] == PROMPTS
    assert len(consumed) == len(set(consumed)) == counts["consumed"]
    assert sum(r["delivered"] for r in results) == PROMPTS - stats["dropped_by_reason"].get("requeue_limit", 0)
    assert stats["requeued"] == sum(r["requeued"] for r in results)
    assert version > 1 and counts["consumed"] > 0


def test_dynamic_sampling_on_the_actor_hands_out_only_informative_groups(local_ray):
    buffer = make_buffer_actor(
        capacity=8, max_staleness=100, stale_policy="drop", prompts=PromptStream(NumberTask(), epochs=1)
    )
    ray.get(buffer.configure_admission.remote(True, 1000, 1e6))
    producers = [produce.remote(buffer, seed, True) for seed in (3, 4)]
    consumed: list = []
    version = 0
    while True:
        batch = ray.get(buffer.get_batch.remote(4, version, timeout_s=0.5, allow_partial=True), timeout=60)
        consumed += batch
        version += 1 if batch else 0
        if not batch and ray.get(buffer.stats.remote())["finished"]:
            break
    ray.get(producers, timeout=60)
    counts = ray.get(buffer.check_accounting.remote())
    stats = ray.get(buffer.stats.remote())
    assert consumed and all(len(set(g.rewards)) == 2 for g in consumed)
    assert all(g.prompt_index % 2 == 1 for g in consumed)
    flat = stats["dropped_by_reason"]["zero_variance"]
    assert flat == stats["zero_variance_groups"] > 0
    assert counts["produced"] == counts["consumed"] + counts["dropped"] == PROMPTS


def test_a_resumed_buffer_whose_state_cannot_be_restored_is_refused_naming_the_file(local_ray, tmp_path):
    folder = tmp_path / "step_00000004"
    with pytest.raises(ResumeError, match=rf"{folder}/run_state.json: the rollout buffer's state cannot be "
                       r"restored \(KeyError: 'groups'\)"):  # fmt: skip
        start_buffer(load_config("configs/quickstart.yaml"), NumberTask(), {"buffer": {"format": 1}}, folder)
