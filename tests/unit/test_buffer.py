"""The rollout buffer as a plain class: accounting after every operation, staleness, capacity, requeue,
checkpoints and errors."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import types

import pytest

from megatron_rl.config import BufferConfig, load_config
from megatron_rl.rollout.buffer import AccountingError, RolloutBuffer, RolloutBufferError
from megatron_rl.rollout.burst import generate_groups
from megatron_rl.rollout.driver import GenerationDriver
from megatron_rl.rollout.engine import GenerationResult
from megatron_rl.rollout.tasks import PromptStream, Task
from megatron_rl.rollout.types import Group, Sample


class ListTask(Task):
    """`count` prompts numbered 0..count-1 (endless when count is None); reward unused."""

    name = "list"

    def __init__(self, count: int | None = None):
        super().__init__()
        self.count = count

    def prompts(self, epoch=0, start=0):
        index = start
        while self.count is None or index < self.count:
            yield {"prompt": f"p{epoch}.{index}", "prompt_ids": [3, index % 500], "answer": index}
            index += 1

    def reward(self, response, answer, sample=None):
        return 0.0


def make_buffer(count: int | None = None, epochs: int | None = None, **kwargs) -> RolloutBuffer:
    return RolloutBuffer(prompts=PromptStream(ListTask(count), epochs=epochs), **kwargs)


def make_group(index: int, version: int = 0, size: int = 2, reward: float = 1.0, tokens: int = 3) -> Group:
    samples = [
        Sample(
            prompt_ids=[3, 4],
            response_ids=[5] * tokens,
            logprobs=[-0.5] * tokens,
            versions=[version] * tokens,
            reward=reward,
            prompt_index=index,
            engine="e0",
        )
        for _ in range(size)
    ]
    return Group(index, samples)


def fill(buffer: RolloutBuffer, n: int, version: int = 0) -> list[int]:
    """Claim n prompts and deliver a group for each; returns their indices."""
    indices = [i for i, _ in buffer.claim_prompts(n)]
    for i in indices:
        assert buffer.put_group(make_group(i, version))
    buffer.check_accounting()
    return indices


def test_claim_put_get_round_trip():
    buffer = make_buffer(capacity=8)
    claimed = buffer.claim_prompts(3)
    assert [i for i, _ in claimed] == [0, 1, 2]
    assert claimed[1][1]["prompt"] == "p0.1"
    assert buffer.check_accounting() == {
        "drawn": 3,
        "produced": 3,
        "in_flight": 3,
        "buffered": 0,
        "consumed": 0,
        "dropped": 0,
        "retry_pending": 0,
    }
    for i, _ in claimed:
        assert buffer.put_group(make_group(i))
    batch = buffer.get_batch(2, current_version=0)
    assert [g.prompt_index for g in batch] == [0, 1]
    assert batch[0].metadata["prompt"]["answer"] == 0
    counts = buffer.check_accounting()
    assert (counts["consumed"], counts["buffered"], counts["in_flight"]) == (2, 1, 0)


def test_oldest_first_by_token_version():
    buffer = make_buffer(capacity=8)
    indices = [i for i, _ in buffer.claim_prompts(3)]
    for i, version in zip(indices, (2, 0, 1)):
        buffer.put_group(make_group(i, version))
    assert [g.min_version() for g in buffer.get_batch(3, current_version=2)] == [0, 1, 2]


def test_partial_rollout_is_as_old_as_its_oldest_token():
    group = make_group(0, version=5)
    group.samples[1].versions = [3, 4, 5]
    assert (group.min_version(), group.max_version(), group.staleness(7)) == (3, 5, 4)


@pytest.mark.parametrize("policy", ["drop", "correct"])
def test_staleness_policy(policy):
    buffer = make_buffer(capacity=8, max_staleness=1, stale_policy=policy)
    fill(buffer, 1, version=0)
    fill(buffer, 1, version=1)
    fill(buffer, 1, version=2)
    batch = buffer.get_batch(2, current_version=2)
    counts = buffer.check_accounting()
    if policy == "drop":
        # version 0 is 2 behind: dropped at hand-out time, the next two fill the batch
        assert [g.min_version() for g in batch] == [1, 2]
        assert not any(g.stale for g in batch)
        assert buffer.stats()["dropped_by_reason"] == {"stale": 1}
        assert counts["dropped"] == 1 and counts["buffered"] == 0
    else:
        assert [g.min_version() for g in batch] == [0, 1]
        assert [g.stale for g in batch] == [True, False]
        assert buffer.stats()["corrected"] == 1
        assert counts["dropped"] == 0 and counts["buffered"] == 1


def test_stale_group_is_dropped_on_arrival_once_the_trainer_moved_on():
    buffer = make_buffer(capacity=4, max_staleness=1)
    (index, _), (late, _) = buffer.claim_prompts(2)
    buffer.put_group(make_group(index, version=5))
    buffer.set_trainer_version(5)
    assert buffer.put_group(make_group(late, version=3)) is False
    assert buffer.stats()["recent_drops"][-1]["prompt_index"] == late
    assert "2 behind trainer version 5" in buffer.stats()["recent_drops"][-1]["detail"]
    buffer.set_trainer_version(7)  # now the first one is stale too, and its slot frees up for generation
    assert buffer.check_accounting()["buffered"] == 0
    assert buffer.stats()["free_slots"] == 4


def test_capacity_counts_in_flight_and_buffered():
    buffer = make_buffer(capacity=4)
    assert len(buffer.claim_prompts(3)) == 3
    assert len(buffer.claim_prompts(3)) == 1  # one slot left
    assert buffer.claim_prompts(1) == []
    for i in range(4):
        buffer.put_group(make_group(i))
    assert buffer.claim_prompts(1) == []  # full of buffered groups now
    buffer.get_batch(2, current_version=0)
    assert len(buffer.claim_prompts(5)) == 2
    buffer.check_accounting()


def test_claim_waits_for_a_slot():
    buffer = make_buffer(capacity=2)
    fill(buffer, 2)
    consumer = threading.Timer(0.2, lambda: buffer.get_batch(1, current_version=0))
    consumer.start()
    start = time.monotonic()
    claimed = buffer.claim_prompts(2, timeout_s=5.0)
    assert len(claimed) == 1 and 0.1 < time.monotonic() - start < 4.0
    consumer.join()
    buffer.check_accounting()


def test_claim_wakes_when_stale_groups_are_evicted():
    buffer = make_buffer(capacity=2, max_staleness=0)
    fill(buffer, 2, version=0)
    threading.Timer(0.1, lambda: buffer.set_trainer_version(1)).start()
    assert len(buffer.claim_prompts(2, timeout_s=10.0)) == 2
    assert buffer.check_accounting()["dropped"] == 2


def test_get_batch_waits_then_times_out_without_consuming():
    buffer = make_buffer(capacity=4)
    fill(buffer, 1)
    start = time.monotonic()
    assert buffer.get_batch(2, current_version=0, timeout_s=0.2) == []
    assert time.monotonic() - start >= 0.19
    assert buffer.check_accounting()["buffered"] == 1


def test_get_batch_wakes_when_a_group_arrives():
    buffer = make_buffer(capacity=4)
    (index, _), (other, _) = buffer.claim_prompts(2)
    buffer.put_group(make_group(index))
    threading.Timer(0.1, lambda: buffer.put_group(make_group(other))).start()
    batch = buffer.get_batch(2, current_version=0, timeout_s=10.0)
    assert sorted(g.prompt_index for g in batch) == [index, other]


def test_requeue_generates_again_and_counts_once():
    buffer = make_buffer(capacity=4, max_requeues=1)
    (first, prompt), (second, _) = buffer.claim_prompts(2)
    assert buffer.requeue(first, "engine e0 died")
    counts = buffer.check_accounting()
    assert (counts["produced"], counts["in_flight"], counts["retry_pending"]) == (1, 1, 1)
    again = buffer.claim_prompts(2)
    assert again[0] == (first, prompt)  # the requeued prompt comes first, same record
    assert again[1][0] == 2
    assert buffer.check_accounting()["produced"] == 3
    # the second requeue of the same prompt exceeds max_requeues=1: dropped and counted
    assert buffer.requeue(first, "engine e1 died") is False
    stats = buffer.stats()
    assert stats["dropped_by_reason"] == {"requeue_limit": 1}
    assert "e1 died" in stats["recent_drops"][-1]["detail"]
    buffer.put_group(make_group(second))
    buffer.check_accounting()


def test_invalid_groups_are_dropped_and_counted():
    buffer = make_buffer(capacity=8)
    a, b, c = (i for i, _ in buffer.claim_prompts(3))
    bad = make_group(a, reward=float("nan"))
    bad.samples[0].metadata["reward_error"] = "reward 'x' raised ZeroDivisionError"
    assert buffer.put_group(bad) is False
    assert buffer.put_group(make_group(b, reward=float("inf"))) is False
    assert buffer.put_group(make_group(c, tokens=0)) is False
    stats = buffer.stats()
    assert stats["dropped_by_reason"] == {"bad_reward": 2, "invalid": 1}
    assert stats["recent_drops"][0]["prompt_index"] == a
    assert "ZeroDivisionError" in stats["recent_drops"][0]["detail"]
    buffer.check_accounting()


def test_a_bursts_groups_go_in_one_call_and_a_refused_one_does_not_lose_the_others():
    buffer = make_buffer(capacity=8)
    a, b, c = (i for i, _ in buffer.claim_prompts(3))
    outcomes = buffer.put_groups([make_group(a), make_group(99), make_group(b, tokens=0), make_group(c)])
    assert outcomes[0] is True and outcomes[2] is False and outcomes[3] is True
    assert isinstance(outcomes[1], RolloutBufferError) and "prompt 99 is not in flight" in str(outcomes[1])
    counts = buffer.check_accounting()
    assert (counts["buffered"], counts["in_flight"]) == (2, 0) and buffer.stats()["dropped_by_reason"] == {"invalid": 1}


def test_errors_name_the_problem():
    buffer = make_buffer(count=3, capacity=4)
    with pytest.raises(RolloutBufferError, match="prompt 0 is not in flight .*never handed out"):
        buffer.put_group(make_group(0))
    (index, _), (other, _) = buffer.claim_prompts(2)
    buffer.put_group(make_group(index))
    with pytest.raises(RolloutBufferError, match="already buffered"):
        buffer.put_group(make_group(index))
    buffer.get_batch(1, current_version=0)
    with pytest.raises(RolloutBufferError, match="already consumed or dropped"):
        buffer.put_group(make_group(index))
    buffer.requeue(other)
    with pytest.raises(RolloutBufferError, match="requeued"):
        buffer.requeue(other)
    mixed = make_group(other)
    mixed.samples[1].prompt_index = 99
    with pytest.raises(RolloutBufferError, match="sample 1 belongs to prompt 99"):
        buffer.put_group(mixed)
    with pytest.raises(RolloutBufferError, match="has no samples"):
        buffer.put_group(Group(other, []))
    with pytest.raises(RolloutBufferError, match="num_groups=5 must be in"):
        buffer.get_batch(5, current_version=0)
    with pytest.raises(RolloutBufferError, match="stale_policy='keep'"):
        RolloutBuffer(stale_policy="keep")
    with pytest.raises(RolloutBufferError, match="no prompt stream"):
        RolloutBuffer().claim_prompts(1)
    with pytest.raises(RolloutBufferError, match="format"):
        buffer.load_state_dict({"format": 99})
    with pytest.raises(ValueError, match="3 response tokens but 2 logprobs"):
        Sample([1], [1, 2, 3], [0.0, 0.0], [0, 0, 0])
    buffer.check_accounting()


def test_check_accounting_catches_a_broken_identity():
    buffer = make_buffer()
    fill(buffer, 2)
    buffer._counters["consumed"] += 1  # simulate a bookkeeping bug
    with pytest.raises(AccountingError, match="produced 2 != consumed"):
        buffer.check_accounting()


def test_check_accounting_catches_a_prompt_handed_to_the_trainer_twice():
    buffer = make_buffer()
    fill(buffer, 2)
    (group,) = buffer.get_batch(1, current_version=0)
    buffer._heap.append((0, 99, group))  # simulate a bug that buffers a consumed group again
    buffer.get_batch(2, current_version=0)
    with pytest.raises(AccountingError, match="1 prompt\\(s\\) were handed to the trainer twice"):
        buffer.check_accounting()


def test_the_handed_out_twice_check_survives_a_resume():
    buffer = make_buffer()
    fill(buffer, 2)
    (group,) = buffer.get_batch(1, current_version=0)
    restored = make_buffer()
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    restored._heap.append((0, 99, group))  # a resume bug that hands a consumed group out again
    restored.get_batch(2, current_version=0)
    with pytest.raises(AccountingError, match="1 prompt\\(s\\) were handed to the trainer twice"):
        restored.check_accounting()


def test_consumed_indices_are_stored_as_runs():
    from megatron_rl.rollout.buffer import index_ranges, indices_of_ranges

    indices = {0, 1, 2, 3, 7, 9, 10}
    assert index_ranges(indices) == [[0, 3], [7, 7], [9, 10]]
    assert indices_of_ranges(index_ranges(indices)) == indices
    assert index_ranges(set()) == [] and indices_of_ranges([]) == set()


def test_finite_stream_ends_with_a_partial_batch():
    buffer = make_buffer(count=3, epochs=1, capacity=8)
    fill(buffer, 5)  # only 3 exist
    assert buffer.stats()["finished"] is True
    assert buffer.get_batch(4, current_version=0, timeout_s=5.0) == []  # returns at once: nothing more can come
    assert len(buffer.get_batch(4, current_version=0, allow_partial=True)) == 3
    assert buffer.check_accounting() == {
        "drawn": 3,
        "produced": 3,
        "in_flight": 0,
        "buffered": 0,
        "consumed": 3,
        "dropped": 0,
        "retry_pending": 0,
    }


def test_state_dict_round_trip_through_json():
    buffer = make_buffer(capacity=8, max_staleness=2)
    fill(buffer, 3, version=1)
    buffer.get_batch(1, current_version=1)
    requeued, in_flight, bad = (i for i, _ in buffer.claim_prompts(3))
    buffer.requeue(requeued)
    buffer.put_group(make_group(bad, reward=float("nan")))
    state = json.loads(json.dumps(buffer.state_dict()))

    restored = make_buffer(capacity=8, max_staleness=2)
    restored.load_state_dict(state)
    counts = restored.check_accounting()
    # the prompts in flight at save time are requeued: claimed again first, then the stream continues
    assert counts["in_flight"] == 0 and counts["retry_pending"] == 2
    assert counts["buffered"] == 2 and counts["consumed"] == 1 and counts["dropped"] == 1
    assert [i for i, _ in restored.claim_prompts(3)] == [requeued, in_flight, 6]
    assert [g.to_dict() for g in restored.get_batch(2, current_version=1)] == [
        g.to_dict() for g in buffer.get_batch(2, current_version=1)
    ]
    assert restored.stats()["dropped_by_reason"] == {"bad_reward": 1}
    restored.check_accounting()


def run_to_a_save(per_step: int, steps: int) -> dict:
    """The state a run one step ahead (lag 1) saves after its trainer took step `steps`' batch: as
    `TrainerLoop.save_checkpoint` does, before the trainer's version `steps` is out, with prompts in flight."""
    buffer, in_flight = make_buffer(capacity=16, max_staleness=1), set()
    for step in range(steps):
        in_flight |= {index for index, _ in _gated(buffer, 16, per_step=per_step, lag=1)}
        for index in sorted(i for i in in_flight if i < (step + 1) * per_step):  # this step's come back
            buffer.put_group(make_group(index, version=step))
            in_flight.discard(index)
        assert len(buffer.get_batch(per_step, step)) == per_step
        if step + 1 < steps:
            buffer.set_trainer_version(step + 1)
    return json.loads(json.dumps(buffer.state_dict()))


@pytest.mark.parametrize("per_step", [2, 1, 4])
def test_a_resumed_gate_waits_for_the_trainers_version_and_counts_from_there(per_step):
    # Saved by a run of 2 prompts a step at step 3 (prompts 6, 7 in flight). The new engines hold the start-up
    # weights until the trainer has loaded step 3 and pushed it: nothing may be claimed before it says so (the
    # requeued prompts would come back at version 0, stale or off-policy). Then the gate opens as the
    # uninterrupted run's did, also where the resumed run takes another number of prompts a step.
    state = run_to_a_save(per_step=2, steps=3)
    restored = make_buffer(capacity=16, max_staleness=1)
    restored.load_state_dict(state)
    answer = restored.claim_gated(16, per_step, 1, timeout_s=0.05)
    assert answer == {"prompts": [], "trainer_version": 2, "awaiting_trainer": True}
    restored.set_trainer_version(3)
    claimed = [i for i, _ in _gated(restored, 16, per_step=per_step, lag=1)]
    assert claimed == [6, 7, 8, 9, 10, 11, 12, 13][: 2 * per_step]  # the requeued ones first: step 4 and one ahead
    assert restored.claim_gated(1, per_step, 1, timeout_s=0.05)["awaiting_trainer"] is False
    restored.check_accounting()


def test_state_dict_can_keep_in_flight_prompts():
    buffer = make_buffer(capacity=8)
    claimed = [i for i, _ in buffer.claim_prompts(2)]
    restored = make_buffer(capacity=8)
    restored.load_state_dict(buffer.state_dict(), requeue_in_flight=False)
    for i in claimed:
        assert restored.put_group(make_group(i))
    assert restored.check_accounting()["buffered"] == 2


def test_from_config():
    buffer = RolloutBuffer.from_config(BufferConfig(capacity=5, max_staleness=0, stale_policy="correct"))
    assert (buffer.capacity, buffer.max_staleness, buffer.stale_policy) == (5, 0, "correct")


@pytest.mark.parametrize("seed", range(6))
def test_randomized_operations_keep_the_accounting(seed):
    """Random claims, deliveries (some invalid or old), requeues, version bumps and batches; the identity
    holds after every step, no prompt is consumed twice, and draining accounts for every prompt once."""
    rng = random.Random(seed)
    policy = rng.choice(["drop", "correct"])
    buffer = make_buffer(capacity=rng.randint(4, 12), max_staleness=rng.randint(0, 2), stale_policy=policy)
    in_flight: list[int] = []
    consumed: list[int] = []
    version = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            in_flight += [i for i, _ in buffer.claim_prompts(rng.randint(1, 4))]
        elif op < 0.6 and in_flight:
            index = in_flight.pop(rng.randrange(len(in_flight)))
            reward = float("nan") if rng.random() < 0.1 else rng.random()
            buffer.put_group(make_group(index, version=max(0, version - rng.randint(0, 3)), reward=reward))
        elif op < 0.7 and in_flight:
            index = in_flight.pop(rng.randrange(len(in_flight)))
            buffer.requeue(index, "engine died")  # requeued or dropped: either way no longer ours
        elif op < 0.8:
            version += 1
            buffer.set_trainer_version(version)
        else:
            consumed += [g.prompt_index for g in buffer.get_batch(rng.randint(1, buffer.capacity), version)]
        buffer.check_accounting()
    assert len(consumed) == len(set(consumed))
    for index in in_flight:
        buffer.put_group(make_group(index, version=version))
    # drain: every prompt ever produced is now consumed or dropped, exactly once
    while (left := buffer.check_accounting()["buffered"]) > 0:
        consumed += [g.prompt_index for g in buffer.get_batch(min(left, buffer.capacity), version)]
    counts = buffer.check_accounting()
    assert len(consumed) == len(set(consumed)) == counts["consumed"] > 0
    assert counts["produced"] == counts["consumed"] + counts["dropped"]
    assert counts["drawn"] == counts["produced"] + counts["retry_pending"]


def test_concurrent_threads_keep_the_accounting():
    """Two producer threads and one consumer thread hammer one buffer."""
    buffer = make_buffer(count=200, epochs=1, capacity=16, max_staleness=1)
    version = {"v": 0}
    consumed: list[int] = []
    errors: list[BaseException] = []

    def produce(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not buffer.stats()["finished"]:
                for index, _ in buffer.claim_prompts(rng.randint(1, 4), timeout_s=0.05):
                    if rng.random() < 0.1:
                        buffer.requeue(index, "flaky")
                    else:
                        buffer.put_group(make_group(index, version=version["v"]))
        except BaseException as err:  # surfaced by the main thread
            errors.append(err)

    def consume() -> None:
        try:
            while True:
                batch = buffer.get_batch(4, version["v"], timeout_s=0.05, allow_partial=True)
                consumed.extend(g.prompt_index for g in batch)
                version["v"] += 1 if batch else 0
                if not batch and buffer.stats()["finished"]:
                    return
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=produce, args=(s,)) for s in (1, 2)] + [threading.Thread(target=consume)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)
    counts = buffer.check_accounting()
    assert counts["drawn"] == 200 and counts["in_flight"] == counts["buffered"] == counts["retry_pending"] == 0
    assert counts["consumed"] + counts["dropped"] == 200
    assert len(consumed) == len(set(consumed)) == counts["consumed"]


# ---------------------------------------------------------------------------------------------------------------
# Admission: rewards out of range and dynamic sampling (DAPO).


def make_rewarded_group(index: int, rewards: list[float], version: int = 0) -> Group:
    group = make_group(index, version, size=len(rewards))
    for sample, reward in zip(group.samples, rewards):
        sample.reward = reward
    return group


def test_rewards_beyond_the_bound_are_failures_counted_and_logged(caplog):
    buffer = make_buffer(capacity=8)
    buffer.configure_admission(False, max_abs_reward=1e6)
    indices = [i for i, _ in buffer.claim_prompts(4)]
    with caplog.at_level("WARNING", logger="megatron_rl.rollout.buffer"):
        accepted = [
            buffer.put_group(make_rewarded_group(indices[0], [1e39, 0.0])),  # float32 would make it inf
            buffer.put_group(make_rewarded_group(indices[1], [1e20, 1e20 + 1])),
            buffer.put_group(make_rewarded_group(indices[2], [float("nan"), 0.0])),
            buffer.put_group(make_rewarded_group(indices[3], [-1e6, 1e6])),  # at the bound: kept
        ]
    assert accepted == [False, False, False, True]
    stats = buffer.stats()
    assert stats["dropped_by_reason"] == {"bad_reward": 3}
    assert "beyond algorithm.max_abs_reward=1e+06" in stats["recent_drops"][0]["detail"]
    assert "reward 1e+39 is beyond" in caplog.text
    buffer.check_accounting()


def test_configuring_admission_screens_groups_already_buffered():
    buffer = make_buffer(capacity=8)
    indices = [i for i, _ in buffer.claim_prompts(3)]
    for index, rewards in zip(indices, ([1.0, 1.0], [0.0, 1.0], [5e7, 0.0])):
        assert buffer.put_group(make_rewarded_group(index, rewards))  # no admission configured yet
    assert buffer.configure_admission(True, 4, 1e6) == {"zero_variance": 1, "bad_reward": 1}
    assert [g.prompt_index for g in buffer.get_batch(1, 0)] == [indices[1]]
    buffer.check_accounting()


def test_dynamic_sampling_drops_zero_variance_groups_within_a_bound_per_batch():
    buffer = make_buffer(capacity=16)
    buffer.configure_admission(True, max_zero_variance_drops=2)
    indices = [i for i, _ in buffer.claim_prompts(5)]
    accepted = [buffer.put_group(make_rewarded_group(i, [0.5, 0.5])) for i in indices[:3]]
    assert accepted == [False, False, True]  # the third is past the bound: kept, so the run can go on
    assert buffer.put_group(make_rewarded_group(indices[3], [0.0, 1.0]))
    assert len(buffer.get_batch(2, 0)) == 2  # handing out a batch starts the bound again
    assert not buffer.put_group(make_rewarded_group(indices[4], [1.0, 1.0]))
    stats = buffer.stats()
    assert stats["dropped_by_reason"] == {"zero_variance": 3} and stats["zero_variance_kept"] == 1
    assert stats["groups_screened"] == 5 and stats["zero_variance_groups"] == 4
    buffer.check_accounting()


class ParityTask(Task):
    """Prompt i; the reward of an even prompt is 1 for every response (a zero-variance group), of an odd one 1
    for the response token 6 and 0 for 5."""

    name = "parity"

    def prompts(self, epoch=0, start=0):
        index = start
        while True:
            yield {"prompt": f"p{index}", "prompt_ids": [3, index % 500], "answer": index}
            index += 1

    def reward(self, response, answer, sample=None):
        return 1.0 if answer % 2 == 0 else float(response == "[6]")


class AlternatingEngine:
    """Answers requests with token 5 and 6 in turn (the two samples of a group differ) at the given version."""

    def __init__(self):
        self.calls = 0
        self.version = 0

    async def _generate(self, req):
        self.calls += 1
        token = 5 + self.calls % 2
        return GenerationResult(req.request_id, req.prompt_ids, [token], [-0.1], [self.version], "length", "e0")

    @property
    def generate(self):
        return types.SimpleNamespace(remote=self._generate)

    async def _generate_groups(self, groups, timeout_s):
        return await generate_groups(groups, self._generate, timeout_s)  # as VLLMEngine.generate_groups

    @property
    def generate_groups(self):
        return types.SimpleNamespace(remote=self._generate_groups)


class Local:
    """A plain object behind Ray's call syntax, awaited like an ObjectRef (the method runs in a thread)."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return types.SimpleNamespace(remote=lambda *args: asyncio.to_thread(method, *args))


class IdsTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return str(list(ids))


def test_half_zero_variance_groups_still_give_full_batches_of_informative_groups():
    """The real generation driver in sync mode (lag 0) against the buffer: every even prompt's group has zero
    variance and is dropped; the gate counts only live prompts, so generation keeps drawing until each step's
    batch is full, and the accounting stays exact."""
    cfg = load_config(
        "configs/quickstart.yaml",
        ["prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_concurrent_prompts=2",
         "algorithm.dynamic_sampling=true"],
    )  # fmt: skip
    buffer = RolloutBuffer(capacity=16, prompts=PromptStream(ParityTask()))
    buffer.configure_admission(True, cfg.algorithm.dynamic_sampling_max_drops, cfg.algorithm.max_abs_reward)
    engine = AlternatingEngine()
    driver = GenerationDriver(Local(buffer), {"e0": engine}, ParityTask(), IdsTokenizer(), cfg, lag=0)
    batches = []

    async def trainer():
        for version in range(3):
            batch = await asyncio.to_thread(buffer.get_batch, 4, version, 10.0)
            assert batch, f"no batch at version {version}: {buffer.check_accounting()}"
            batches.append(batch)
            engine.version = version + 1
            buffer.set_trainer_version(version + 1)

    async def main():
        run = asyncio.create_task(driver.run())
        try:
            await asyncio.wait_for(trainer(), 30)
        finally:
            driver.stop()
            await asyncio.wait_for(run, 10)

    asyncio.run(main())
    assert [len(b) for b in batches] == [4, 4, 4]
    for batch in batches:
        assert all(len(set(g.rewards)) == 2 for g in batch)  # informative groups only
        assert all(g.prompt_index % 2 == 1 for g in batch)
    counts, stats = buffer.check_accounting(), buffer.stats()
    dropped = stats["dropped_by_reason"]["zero_variance"]
    assert counts["consumed"] == 12 and dropped >= 12  # about as many even prompts as odd ones were drawn
    assert counts["produced"] == counts["consumed"] + counts["dropped"] + counts["buffered"] + counts["in_flight"]
    assert stats["groups_screened"] == stats["zero_variance_groups"] + counts["consumed"] + counts["buffered"]
    assert driver.stats.dropped_by_buffer == dropped


def test_the_buffer_measures_the_trainers_wait_from_its_first_ask_and_reports_the_lookahead():
    buffer = make_buffer(40, capacity=16, max_staleness=4)
    assert buffer.stats()["lookahead_prompts"] is None  # not configured: the driver keeps its fixed lag
    assert buffer.configure_lookahead(prompts_per_step=2, max_steps=4) == 2
    for step in range(buffer.lookahead.patience + 1):  # batches ready before the trainer asks: no waits
        for index, _record in buffer.claim_prompts(2):
            buffer.put_group(make_group(index, step))
        time.sleep(0.05)  # the trainer's step, during which the next batch was generated
        assert len(buffer.get_batch(2, step)) == 2
    assert buffer.stats()["lookahead_prompts"] == 1  # one prompt lower after `patience` cycles without a wait
    step += 1
    # Now the trainer asks first (short timeouts, retried) and waits: the wait counts from its first ask.
    before = buffer.lookahead.prompts
    assert buffer.get_batch(2, step, timeout_s=0.05) == []
    assert buffer.get_batch(2, step, timeout_s=0.05) == []
    for index, _record in buffer.claim_prompts(2):
        buffer.put_group(make_group(index, step))
    assert len(buffer.get_batch(2, step)) == 2
    assert buffer.stats()["lookahead_prompts"] == min(8, before + 1)
    buffer.check_accounting()


def _gated(buffer: RolloutBuffer, *args, **kwargs) -> list:
    """The prompts of a `claim_gated` call (its trainer version checked against the buffer's)."""
    answer = buffer.claim_gated(*args, **kwargs)
    assert answer["trainer_version"] == buffer.trainer_version
    return answer["prompts"]


def test_claim_gated_lets_through_what_the_gate_allows_and_waits_for_the_next_version():
    buffer = make_buffer(capacity=16)
    # 2 prompts a step, one step of lag: the steps up to version 0 + 1, 4 prompts.
    assert [i for i, _ in _gated(buffer, 10, per_step=2, lag=1)] == [0, 1, 2, 3]
    assert _gated(buffer, 1, per_step=2, lag=1, timeout_s=0.05) == []  # shut until the trainer moves on
    opened = threading.Timer(0.1, buffer.set_trainer_version, args=(1,))
    opened.start()
    start = time.monotonic()
    assert [i for i, _ in _gated(buffer, 10, per_step=2, lag=1, timeout_s=5)] == [4, 5]
    assert time.monotonic() - start < 2  # woken by the new version, not at its deadline
    # A dropped group frees its place: the gate counts what the buffer accounts for, not what was claimed.
    assert buffer.put_group(make_group(0, tokens=0)) is False
    assert [i for i, _ in _gated(buffer, 10, per_step=2, lag=1)] == [6]
    # The lookahead, where configured, lowers the bound: one prompt ahead of the trainer's step.
    assert buffer.configure_lookahead(prompts_per_step=2, max_steps=1) == 2
    buffer.lookahead.prompts = 1
    buffer.set_trainer_version(2)  # up to step 3's prompts (6) + 1 ahead: 7 live, one more than now
    assert [i for i, _ in _gated(buffer, 10, per_step=2, lag=1)] == [7]
    assert _gated(buffer, 10, per_step=2, lag=1, timeout_s=0.05) == []
    buffer.check_accounting()


def test_claim_gated_waits_out_its_timeout_when_the_stream_is_used_up():
    buffer = make_buffer(2, epochs=1, capacity=8)
    assert len(_gated(buffer, 5, per_step=2, lag=1)) == 2
    start = time.monotonic()
    assert _gated(buffer, 5, per_step=2, lag=1, timeout_s=0.1) == []
    assert _gated(buffer, 5, per_step=2, lag=1, timeout_s=0.1) == []
    assert time.monotonic() - start >= 0.15  # no busy loop of empty answers for a caller that asks again
    with pytest.raises(RolloutBufferError, match="per_step=0 >= 1"):
        _gated(buffer, 1, per_step=0, lag=1)


def test_released_prompts_come_first_and_are_no_requeues():
    buffer = make_buffer(capacity=8, max_requeues=0)
    claimed = buffer.claim_prompts(3)
    buffer.release([claimed[1][0], claimed[2][0]])
    counts = buffer.check_accounting()
    assert (counts["produced"], counts["in_flight"], counts["retry_pending"]) == (1, 1, 2)
    assert buffer.stats()["requeued"] == 0
    again = buffer.claim_prompts(3)
    assert again[:2] == claimed[1:] and again[2][0] == 3  # the released ones first, in order, then the stream
    with pytest.raises(RolloutBufferError, match=r"release: prompts \[9\] are not in flight"):
        buffer.release([9])
    buffer.check_accounting()
