"""The generation driver: keeps every engine busy, scores responses off the critical path, fills the buffer.

It runs as asyncio tasks in the launching process. Each engine gets `max_concurrent_prompts` workers; a worker
claims a prompt, generates `samples_per_prompt` responses on its engine, scores them (plain reward functions in
a thread pool, `async` ones on the loop, each call within `task.reward_timeout_s`) and puts the group into the
buffer. A gate bounds how far generation runs ahead of the trainer: the groups for step s
are only claimed once the trainer's weights are at version >= s - lag (lag 0: sync, 1: one step off, async:
max_staleness). In async mode with `buffer.lookahead: adaptive` the buffer lowers that bound, in prompts, to what
keeps the trainer fed (`rollout/lookahead.py`). The gate counts the prompts the buffer still accounts for
(consumed, buffered, in flight), so a dropped or requeued prompt frees its place for another and the trainer's
batch still fills. The buffer applies it (`RolloutBuffer.claim_gated`); one claim takes prompts for every free
worker and deals them out over the engines.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time

import ray

from megatron_rl.errors import UserError, error_line
from megatron_rl.rollout.burst import CallBatcher
from megatron_rl.rollout.control import CALL_TIMEOUT_S
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.rewards import RewardRunner
from megatron_rl.rollout.types import Group, Sample

MODE_LAG = {"sync": 0, "one_step_off": 1}
SEED_STRIDE = 1 << 12  # samples per prompt that get distinct seeds; far above any group size in use
GATE_POLL_S = 0.05  # how often a worker waiting for an engine to recover asks it again
GATE_WAIT_S = 0.2  # longest a claim waits in the buffer for the gate to open (a stop is seen that soon)
BURST_WAIT_S = 0.05  # longest a burst's calls wait for its missing members (rollout/burst.py)

log = logging.getLogger(__name__)


def request_seed(base_seed: int, prompt_index: int, sample: int) -> int:
    """The sampling seed of one response: fixed by the run seed, the prompt's data position and the sample.

    Fixed per request (not drawn from the engine's stream) so that what a prompt generates does not depend on
    which engine or batch it lands in, or on a restart: a resumed sync-mode run repeats the uninterrupted one.
    """
    return (base_seed * 1_000_003 + prompt_index * SEED_STRIDE + sample) % (1 << 63)


def mode_lag(mode: str, max_staleness: int) -> int:
    """How many versions generation may run ahead of the trainer in each loop mode."""
    return MODE_LAG.get(mode, max(1, max_staleness))


class GenerationError(UserError, RuntimeError):
    """Generation cannot go on (the message says why); the launcher stops the trainer and exits non-zero."""


class RewardError(GenerationError):
    """The reward function fails on every group: the run cannot learn anything, so it stops."""


class TeacherError(RuntimeError):
    """The teacher could not score one group (on-policy distillation); the driver requeues its prompt."""


@dataclasses.dataclass
class DriverStats:
    """Counters the driver reports with the metrics."""

    claimed: int = 0
    groups: int = 0
    dropped_by_buffer: int = 0
    requeued: int = 0
    engine_failures: int = 0
    engine_restarts: int = 0
    bad_reward_groups: int = 0
    teacher_failures: int = 0
    generated_tokens: int = 0
    gate_wait_s: float = 0.0


class GenerationDriver:
    """Continuous generation into the rollout buffer (see module docstring)."""

    def __init__(self, buffer, engines: dict[str, object], task, tokenizer, cfg, lag: int, teacher=None):
        self.buffer = buffer
        self.teacher = teacher
        """The teacher's scorer (`rollout/teacher.py` TeacherScorer) under on-policy distillation, else None."""
        self.engines = engines
        self.task = task
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.lag = lag
        self.stats = DriverStats()
        self.trainer_version = 0
        """The trainer's version as the buffer last told it (the launcher's evaluations follow it)."""
        self._stop = asyncio.Event()
        self._rewards = RewardRunner(
            cfg.task.reward_timeout_s, workers=cfg.task.reward_workers, isolation=cfg.task.reward_isolation
        )
        if task is not None:
            task.set_response_limit(cfg.rollout.max_new_tokens)  # the length penalties' default max_tokens
            self._rewards.start(task.reward_set().functions)  # reward processes, where any, start with the engines
        self._claiming = False
        """Whether a worker is claiming from the buffer now: one claim at a time, so each sees every earlier one."""
        self._claim_done = asyncio.Event()
        """Set when the claim in progress ends: the workers waiting for it look at their engine's prompts again."""
        self._claimed: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        """Engine -> prompts claimed for its workers, not taken by one yet: (index, record, burst)."""
        self._bursts = 0
        """Bursts dealt so far (one per engine per claim; `rollout/burst.py`)."""
        self._calls = CallBatcher(BURST_WAIT_S)
        """A burst's engine call and buffer call, made once for all its groups."""
        self._busy = collections.Counter()
        """Engine -> its workers holding a prompt (from taking it until its group is delivered or given back)."""
        self.failure: BaseException | None = None
        self.down: dict[str, str] = {}
        self._bad_rewards_in_a_row = 0
        """Engines found dead (name -> why); their workers wait until the supervisor brings them back."""

    def mark_down(self, engine: str, reason: str) -> None:
        """Stop routing prompts to `engine` (its in-flight prompts are requeued by their workers)."""
        self.down.setdefault(engine, reason)

    def bring_back(self, engine: str, actor) -> None:
        """Route prompts to `engine` again, now served by `actor` (a restarted engine at current weights)."""
        self.engines[engine] = actor
        self.down.pop(engine, None)
        self.stats.engine_restarts += 1

    def stop(self) -> None:
        """Ask every worker to finish its current group and exit."""
        self._stop.set()

    async def run(self) -> DriverStats:
        """Run until stopped (or the prompts run out); returns the counters."""
        per_engine = self.cfg.rollout.max_concurrent_prompts
        workers = [asyncio.ensure_future(self._worker(name)) for name in self.engines for _ in range(per_engine)]
        try:
            await asyncio.gather(*workers)
            await self._release_unstarted()
        finally:
            # One worker's error (or a cancel) ends them all: a leftover worker would score on a closed reward pool.
            for worker in workers:
                worker.cancel()
            self._calls.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._rewards.shutdown()
        return self.stats

    async def _call_buffer(self, method: str, *args):
        """`buffer.method(*args)`; GenerationError naming the call when the buffer does not answer in time."""
        try:
            return await asyncio.wait_for(getattr(self.buffer, method).remote(*args), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise GenerationError(
                f"buffer.{method} did not answer within {CALL_TIMEOUT_S:g} s; is the buffer actor alive?"
            ) from None

    async def _claim(self, engine: str) -> tuple[int, dict, tuple[int, int]] | None:
        """One prompt for a worker of `engine`, when the gate allows it (the step it serves is close enough to the
        trainer; `RolloutBuffer.claim_gated`).

        Claims are serialized, so each sees every earlier claim of this driver. A claim takes a prompt for every
        free worker of every engine that is up (as many as the gate lets through) and deals them out in turn,
        this worker's engine first: a step's prompts reach the engines together, and each batches its share. The
        other workers take theirs from `_claimed` without asking the buffer, also while a claim waits at the gate
        (the step cannot fill without the prompts dealt to them)."""
        start = time.perf_counter()
        # An engine that goes down while its worker waits here claims nothing: its actor handle is the dead one
        # until the restart, and the prompt would fail on it and be requeued once more by each waiting worker.
        while not self._stop.is_set() and engine not in self.down:
            if self._claimed[engine]:
                self._busy[engine] += 1
                return self._claimed[engine].popleft()
            if self._claiming:
                await self._claim_done.wait()
            else:
                await self._claim_for_every_engine(engine, start)
        return None

    async def _claim_for_every_engine(self, engine: str, start: float) -> None:
        """One claim from the buffer for the free workers of every engine, dealt out (`_claim`)."""
        self._claiming, done = True, asyncio.Event()
        self._claim_done = done
        try:
            free = self._free_workers()
            answer = await self._call_buffer(
                "claim_gated", sum(free.values()), self.cfg.prompts_per_step, self.lag, GATE_WAIT_S
            )
            claimed = answer["prompts"]
            if not answer.get("awaiting_trainer"):  # a resumed run's engines hold the start-up weights until then
                self.trainer_version = answer["trainer_version"]
            if claimed and (self._stop.is_set() or engine in self.down):  # while the buffer held the call
                await self._call_buffer("release", [index for index, _ in claimed])
            elif claimed:
                self.stats.claimed += len(claimed)
                self.stats.gate_wait_s += time.perf_counter() - start
                self._deal(claimed, engine, free)
        finally:
            self._claiming = False
            done.set()

    def _free_workers(self) -> dict[str, int]:
        """Engine (up) -> its workers that hold no prompt and have none waiting for them in `_claimed`."""
        per_engine = self.cfg.rollout.max_concurrent_prompts
        return {
            name: per_engine - self._busy[name] - len(self._claimed[name])
            for name in self.engines
            if name not in self.down
        }

    def _deal(self, claimed: list, first: str, free: dict[str, int]) -> None:
        """Deal the claimed prompts to the engines' free workers in turn, engine `first` first."""
        order = [first, *(name for name in free if name != first)]
        left, turn, dealt = dict(free), 0, collections.defaultdict(list)
        for item in claimed:  # no more than the free workers: the claim asked for that many at most
            while left[order[turn % len(order)]] <= 0:
                turn += 1
            name = order[turn % len(order)]
            dealt[name].append(item)
            left[name] -= 1
            turn += 1
        for name, items in dealt.items():  # each engine's share is one burst (rollout/burst.py)
            self._bursts += 1
            self._claimed[name].extend((index, record, (self._bursts, len(items))) for index, record in items)

    async def _release_unstarted(self, engine: str | None = None) -> None:
        """Give the buffer back the prompts claimed for workers of `engine` (default: every engine) that none of
        them took: the engine went down, or the driver stops."""
        queues = [self._claimed[engine]] if engine is not None else list(self._claimed.values())
        unstarted = [index for queue in queues for index, *_ in queue]
        for queue in queues:
            queue.clear()
        if unstarted:
            await self._call_buffer("release", unstarted)

    async def _worker(self, engine: str) -> None:
        while not self._stop.is_set():
            if engine in self.down:  # claim nothing for a dead engine: the prompt would only be requeued
                await self._release_unstarted(engine)
                await asyncio.sleep(0.2)
                continue
            claimed = await self._claim(engine)
            if claimed is None:  # stopped, or the engine went down meanwhile
                continue
            try:
                await self._serve(engine, *claimed)
            finally:
                self._busy[engine] -= 1

    async def _serve(self, engine: str, index: int, record: dict, burst: tuple | None = None) -> None:
        """Generate, score and deliver the group of prompt `index`; a failing engine or teacher gives it back.
        `burst` (id, size): the claim's share of this engine it came in; its groups travel together."""
        bid, size = burst if burst is not None else (None, 1)
        try:
            results = await self._generate(engine, index, record, (("generate", engine, bid), size))
        except Exception as err:  # a dead or failing engine: the prompt goes back, counted once
            self._calls.withdraw(("put", bid), size)
            self.stats.engine_failures += 1
            why = error_line(err)
            if is_actor_death(err):
                self.mark_down(engine, why)
            await self._requeue(index, engine, why)
            self.failure = err
            await self._until_engine_ready(engine)  # claim nothing it would fail (and burn) meanwhile
            return
        try:
            group = await self._score(index, record, results)
        except TeacherError as err:  # the teacher failed (its scorer restarts a dead one): the prompt goes back
            self._calls.withdraw(("put", bid), size)
            self.stats.teacher_failures += 1
            await self._requeue(index, "teacher", str(err))
            return
        # First: a dropped group is accounted for.
        accepted = await self._calls.submit(("put", bid), size, group, self._put_groups)
        if isinstance(accepted, Exception):
            raise accepted
        self.stats.groups += int(accepted)
        self.stats.dropped_by_buffer += int(not accepted)
        self._check_rewards(group)

    async def _put_groups(self, groups: list[Group]) -> list:
        """A burst's groups into the buffer in one call: per group accepted or not, or the buffer's refusal."""
        return await self._call_buffer("put_groups", groups)

    async def _requeue(self, index: int, who: str, why: str) -> None:
        """Give prompt `index` back to the buffer after `who` failed on it (the buffer counts and limits requeues)."""
        requeued = await self._call_buffer("requeue", index, f"{who}: {why}")
        self.stats.requeued += int(requeued)
        outcome = "requeued" if requeued else "dropped by the buffer (requeue limit)"
        log.warning("%s failed on prompt %d (%s); %s", who, index, why, outcome)

    async def _until_engine_ready(self, engine: str) -> None:
        """After a failed request: ask the engine's health before its worker claims again. A dead actor or a dead
        vLLM inside it is marked down (the supervisor restarts it); an engine refusing requests (a failed weight
        update left its weights inconsistent) is waited for until the trainer's next push makes it consistent; a
        healthy engine (the request itself failed) goes on at once.

        Without this each worker would claim a prompt, have it fail and requeue it twice a second until the
        supervisor's probe noticed, and the buffer would drop prompts at their requeue limit.
        """
        while not self._stop.is_set() and engine not in self.down:
            health, dead = await ask_health(self.engines[engine], CALL_TIMEOUT_S)
            if dead is not None:
                self.mark_down(engine, dead)
                return
            if health.get("consistent", False):
                return
            await asyncio.sleep(GATE_POLL_S * 10)  # too slow to answer, or inconsistent: look again later

    def _check_rewards(self, group: Group) -> None:
        """Count groups with a failed reward; too many in a row stop the run with the reward's own error."""
        errors = [s.metadata["reward_error"] for s in group.samples if "reward_error" in s.metadata]
        if not errors:
            self._bad_rewards_in_a_row = 0
            return
        self.stats.bad_reward_groups += 1
        self._bad_rewards_in_a_row += 1
        limit = self.cfg.task.max_bad_reward_groups_in_a_row
        if self._bad_rewards_in_a_row >= limit:
            raise RewardError(
                f"{limit} groups in a row had a failed reward (task.max_bad_reward_groups_in_a_row); "
                f"last: prompt {group.prompt_index}: {errors[-1]}"
            )

    async def _generate(self, engine: str, index: int, record: dict, burst: tuple) -> list:
        """The results of prompt `index`'s group on `engine`, sent in burst `burst` (batcher key, size)."""
        rollout = self.cfg.rollout
        eos = getattr(self.tokenizer, "eos_token_id", None)
        requests = [
            GenerationRequest(
                prompt_ids=list(record["prompt_ids"]),
                max_tokens=rollout.max_new_tokens,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                top_k=rollout.top_k,
                return_kept_sets=self.cfg.returns_kept_sets,
                stop_token_ids=[eos] if eos is not None else [],
                seed=request_seed(self.cfg.trainer.seed, index, sample),
            )
            for sample in range(rollout.samples_per_prompt)
        ]
        key, size = burst
        try:
            results = await self._calls.submit(key, size, requests, functools.partial(self._generate_burst, engine))
            if isinstance(results, Exception):  # this group failed in the engine; the burst's others may not have
                raise results
        except asyncio.TimeoutError:
            raise GenerationError(
                f"engine {engine}: prompt {index} not generated within rollout.request_timeout_s="
                f"{rollout.request_timeout_s:g} s"
            ) from None
        self.stats.generated_tokens += sum(len(r.token_ids) for r in results)
        return list(results)

    async def _generate_burst(self, engine: str, groups: list[list[GenerationRequest]]) -> list:
        """One engine call for a burst's groups (one per prompt; on a small machine Ray's per-call cost is CPU
        that generation needs), within `rollout.request_timeout_s`: per group its results or its error."""
        timeout_s = self.cfg.rollout.request_timeout_s  # each group's, in the engine; here the actor's answer too
        pending = self.engines[engine].generate_groups.remote(groups, timeout_s)
        return await asyncio.wait_for(pending, timeout_s + CALL_TIMEOUT_S)

    async def score(self, texts: list[str], record: dict) -> list[float]:
        """The rewards of decoded responses to one prompt record, in the driver's reward threads with its time
        limit (for evaluation: no samples, nothing goes to the buffer)."""
        return await self.task.score_group(texts, record, None, self._rewards)

    async def _score(self, index: int, record: dict, results: list) -> Group:
        """The group of one prompt's results, each sample with its reward (NaN where the reward failed) and, under
        distillation, its teacher logprobs (scored at the same time; TeacherError when the teacher failed)."""
        samples = [Sample.from_generation(r, index, group_id=str(index), sample=i) for i, r in enumerate(results)]
        texts = [self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
        scoring = [self.task.score_group(texts, record, samples, self._rewards)]
        if self.teacher is not None:
            scoring.append(self.teacher.score(samples))
        rewards, *_ = await asyncio.gather(*scoring)
        for sample, reward in zip(samples, rewards):
            sample.reward = reward
        return Group(index, samples)


async def ask_health(actor, timeout_s: float) -> tuple[dict, str | None]:
    """An engine actor's health report ({} when it did not answer in time, or failed to) and why the engine is
    dead: its actor is gone, or vLLM inside it is (`alive` False: dead, or stuck in a weight update); None when it
    is not known to be dead."""
    try:
        health = await asyncio.wait_for(actor.health.remote(through_core=True), timeout_s)
    except asyncio.TimeoutError:
        return {}, None
    except Exception as err:
        if is_actor_death(err):
            return {}, error_line(err)
        log.warning("health check failed (%s); not taking the engine as dead", error_line(err))
        return {}, None
    if health.get("alive", True):
        return health, None
    return health, health.get("stuck") or "vLLM inside the actor is dead"


def is_actor_death(err: BaseException) -> bool:
    """Whether `err` says the engine's actor process is gone (rather than that one request failed)."""

    return isinstance(err, ray.exceptions.RayActorError)
