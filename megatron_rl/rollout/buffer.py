"""The rollout buffer between the engines and the trainer, with exact-once accounting of prompts.

Life of a prompt (its index is its data position in the `PromptStream`):

    claim_gated / claim_prompts -> in flight --put_group--> buffered --get_batch--> consumed
                                      |  \\--requeue--> back to the retry queue (generated again, counted once)
                                      |  \\--release (never started) --> back to the front of the retry queue
                                      \\-- put_group of an invalid group / requeue limit --> dropped[reason]
    buffered --get_batch (stale, policy 'drop') / set_trainer_version--> dropped['stale']

Invariant, checked by `check_accounting()` after anything: produced == consumed + dropped + buffered + in_flight,
where `produced` counts the prompts handed out and not requeued, and drawn == produced + retry_pending.

Admission (`configure_admission`, set by the trainer from `algorithm.*`): a group with a reward beyond
`max_abs_reward` is dropped as 'bad_reward' (like a non-finite one) and logged; with `drop_zero_variance` (DAPO's
dynamic sampling) a group whose rewards are all equal is dropped as 'zero_variance', at most
`max_zero_variance_drops` per batch handed out (past that it is kept and counted, so a policy that solves or fails
every prompt still trains). A dropped prompt frees its place at the driver's gate, so generation draws another
until the batch is full. Every valid group counts in `groups_screened` and, when its rewards are all equal, in
`zero_variance_groups`, dropped or not.

Claims: the driver's go through `claim_gated`, which also keeps generation within the steps the gate allows
(`max_staleness` or the lookahead ahead of the trainer); `claim_prompts` is the claim without a gate.

Capacity bounds buffered + in-flight groups: a claim reserves a slot for every prompt it hands out, so
`put_group` never refuses for lack of space and no finished group is ever lost; generation waits (claims return
fewer prompts) while the trainer lags.

Concurrency: a threaded class. Every public method holds one lock; the claims and `get_batch` wait on a
condition variable (lock released) up to their timeout. As a Ray actor (`make_buffer_actor`) it runs with
`max_concurrency` threads, so waiting calls must leave at least one thread free for `put_group`.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import threading
import time
from typing import Any, Literal

import ray

from megatron_rl.rollout.burst import portable_error
from megatron_rl.rollout.lookahead import Lookahead
from megatron_rl.rollout.ray_utils import on_this_node
from megatron_rl.rollout.tasks import PromptStream
from megatron_rl.rollout.types import Group

STATE_FORMAT = 1
DROP_LOG_SIZE = 100  # most recent drops kept with their prompt index and why; the counts are always complete

log = logging.getLogger(__name__)


class RolloutBufferError(RuntimeError):
    """A call the buffer refuses (wrong prompt, impossible batch, bad state); the message says why."""


class AccountingError(AssertionError):
    """The prompt accounting identity does not hold (a buffer bug)."""


class RolloutBuffer:
    """Groups waiting for the trainer, the prompts being generated and the counters that account for each."""

    def __init__(
        self,
        capacity: int = 256,
        max_staleness: int = 4,
        stale_policy: Literal["drop", "correct"] = "drop",
        prompts: PromptStream | None = None,
        max_requeues: int = 3,
        drop_zero_variance: bool = False,
        max_zero_variance_drops: int = 64,
        max_abs_reward: float = math.inf,
    ):
        if capacity < 1:
            raise RolloutBufferError(f"capacity must be at least 1, got {capacity}")
        if max_staleness < 0:
            raise RolloutBufferError(f"max_staleness must be at least 0, got {max_staleness}")
        if stale_policy not in ("drop", "correct"):
            raise RolloutBufferError(f"stale_policy={stale_policy!r} is not one of 'drop', 'correct'")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.max_requeues = max_requeues
        self.prompts = prompts
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Group]] = []  # (oldest token version, arrival number, group)
        self._arrivals = 0
        self._in_flight: dict[int, dict] = {}
        self._retry: collections.deque[tuple[int, dict]] = collections.deque()
        self._requeues: dict[int, int] = {}
        self._counters = collections.Counter()  # drawn, produced, consumed, requeued, corrected, staleness_sum
        self._dropped = collections.Counter()
        self._drop_log: collections.deque[dict] = collections.deque(maxlen=DROP_LOG_SIZE)
        self.trainer_version = 0
        self._gate_base = (0, 0)  # (trainer version, prompts consumed) the gate counts from: where a resume went on
        self._awaiting_trainer = False  # resumed, and the engines still hold the start-up weights: the gate is shut
        self._consumed: set[int] = set()  # prompt indices handed to the trainer: none may be handed out twice
        self.drop_zero_variance, self.max_zero_variance_drops, self.max_abs_reward = False, 0, math.inf
        self._zero_variance_drops = 0  # since the last batch handed out (the bound is per batch)
        self._set_admission(drop_zero_variance, max_zero_variance_drops, max_abs_reward)
        self.lookahead: Lookahead | None = None  # `configure_lookahead`: how far generation may run ahead
        self._asked: tuple[int, float] | None = None  # (version, when the trainer first asked for its batch)
        self._last_hand_out: float | None = None

    @classmethod
    def from_config(cls, buffer_cfg, prompts: PromptStream | None = None, max_requeues: int = 3) -> RolloutBuffer:
        """Build from a `BufferConfig`."""
        return cls(buffer_cfg.capacity, buffer_cfg.max_staleness, buffer_cfg.stale_policy, prompts, max_requeues)

    # ------------------------------------------------------------------------------------------------------------
    # Admission.

    def _set_admission(self, drop_zero_variance: bool, max_zero_variance_drops: int, max_abs_reward: float) -> None:
        if max_zero_variance_drops < 0 or not max_abs_reward > 0:
            raise RolloutBufferError(
                f"max_zero_variance_drops={max_zero_variance_drops} must be >= 0 and max_abs_reward={max_abs_reward} > 0"
            )
        self.drop_zero_variance = bool(drop_zero_variance)
        self.max_zero_variance_drops = int(max_zero_variance_drops)
        self.max_abs_reward = float(max_abs_reward)

    def configure_admission(
        self, drop_zero_variance: bool, max_zero_variance_drops: int = 64, max_abs_reward: float = math.inf
    ) -> dict[str, int]:
        """Set what groups must pass (module docstring) and screen the buffered ones again (groups delivered
        before the trainer configured the buffer); returns the drops by reason."""
        with self._cond:
            self._set_admission(drop_zero_variance, max_zero_variance_drops, max_abs_reward)
            keep = []
            for item in self._heap:
                problem = self._reward_problem(item[2]) or self._variance_problem(item[2])
                if problem is None:
                    keep.append(item)
                else:
                    self._drop(item[2].prompt_index, *problem)
            if len(keep) != len(self._heap):
                self._heap = keep
                heapq.heapify(self._heap)
                self._cond.notify_all()
            return dict(self._dropped)

    def _reward_problem(self, group: Group) -> tuple[str, str] | None:
        """('bad_reward', detail) when a reward's magnitude is beyond `max_abs_reward`."""
        for i, sample in enumerate(group.samples):
            if abs(sample.reward) > self.max_abs_reward:
                detail = (
                    f"sample {i} reward {sample.reward!r} is beyond algorithm.max_abs_reward={self.max_abs_reward:g}"
                )
                log.warning("prompt %d: group dropped: %s", group.prompt_index, detail)
                return "bad_reward", detail
        return None

    def _variance_problem(self, group: Group) -> tuple[str, str] | None:
        """('zero_variance', detail) when dynamic sampling drops this group (all rewards equal, bound not reached)."""
        if not (self.drop_zero_variance and _zero_variance(group)):
            return None
        if self._zero_variance_drops >= self.max_zero_variance_drops:
            self._counters["zero_variance_kept"] += 1
            return None
        self._zero_variance_drops += 1
        return "zero_variance", f"all {group.size} rewards are {group.samples[0].reward!r}"

    # ------------------------------------------------------------------------------------------------------------
    # Generation side.

    def claim_prompts(self, n: int, timeout_s: float = 0.0) -> list[tuple[int, dict]]:
        """Hand out up to `n` prompts to generate, as (prompt index, prompt record); they are now in flight.

        Requeued prompts come first. Returns fewer (possibly none) when the buffer is full after waiting up to
        `timeout_s` for a free slot, or when the prompt stream is exhausted.
        """
        if n < 0:
            raise RolloutBufferError(f"claim_prompts: n must be >= 0, got {n}")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._free_slots() == 0 and self._cond.wait(max(0.0, deadline - time.monotonic())):
                pass
            return self._take_prompts(n)

    def _take_prompts(self, n: int) -> list[tuple[int, dict]]:
        """(Under the lock) up to `n` prompts, as many as there are free slots and prompts; now in flight."""
        claimed: list[tuple[int, dict]] = []
        want = min(n, self._free_slots())
        while len(claimed) < want:
            item = self._next_prompt()
            if item is None:
                break
            self._in_flight[item[0]] = item[1]
            self._counters["produced"] += 1
            claimed.append(item)
        return claimed

    def claim_gated(self, n: int, per_step: int, lag: int, timeout_s: float = 0.0) -> dict[str, Any]:
        """`claim_prompts` behind the driver's gate, in one call: up to `n` prompts, no more than the gate lets
        through, waiting up to `timeout_s` for it to open (the trainer's next version) and for a free slot;
        `{"prompts": [(prompt index, record), ...], "trainer_version": the trainer's version now,
        "awaiting_trainer": whether a resumed run's trainer has yet to say its version}`.

        The gate keeps the prompts this buffer accounts for (consumed, buffered and in flight) within the steps up
        to the trainer's version + `lag` (`per_step` prompts a step), or + the lookahead where one is configured
        (`configure_lookahead`), whichever is less. Dropped prompts and requeued ones waiting to be claimed again
        do not count: each frees its place. With lag 0 a step's prompts are claimed only at the version that trains
        on them (exactly on-policy). A resumed run's gate stays shut until its trainer, which first brings the
        engines to its weights, says its version; it then opens as the uninterrupted run's did, also for another
        `per_step` (the counts start there). No prompts when it stays shut. One call instead of a look at the
        counts and a claim per prompt: a step's prompts reach the engines together, which batch them.
        """
        if n < 0 or per_step < 1 or lag < 0:
            raise RolloutBufferError(f"claim_gated: n={n} >= 0, per_step={per_step} >= 1 and lag={lag} >= 0 needed")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            claimed: list[tuple[int, dict]] = []
            while min(self._gate_room(per_step, lag), self._free_slots()) <= 0 or not self._prompts_left():
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    break
            else:
                claimed = self._take_prompts(min(n, self._gate_room(per_step, lag)))
            awaiting = self._awaiting_trainer
            return {"prompts": claimed, "trainer_version": self.trainer_version, "awaiting_trainer": awaiting}

    def _prompts_left(self) -> bool:
        """Whether a claim may find a prompt: one waits to be claimed again, or the stream may have more."""
        return bool(self._retry) or self.prompts is None or not self.prompts.exhausted

    def _gate_room(self, per_step: int, lag: int) -> int:
        """How many more prompts the gate lets through now (`claim_gated`)."""
        if self._awaiting_trainer:
            return 0
        ahead = lag * per_step
        if self.lookahead is not None:
            ahead = min(ahead, self.lookahead.prompts)
        version, consumed = self._gate_base
        live = self._counters["consumed"] - consumed + len(self._heap) + len(self._in_flight)
        return (self.trainer_version - version + 1) * per_step + ahead - live

    def release(self, indices: list[int]) -> None:
        """Take back in-flight prompts that were claimed but never started (their engine went down meanwhile, or
        the driver stopped): first in line to be claimed again, not counted as requeues."""
        with self._cond:
            missing = [i for i in indices if i not in self._in_flight]
            if missing:
                raise RolloutBufferError(f"release: prompts {missing} are not in flight")
            for index in reversed(indices):
                self._retry.appendleft((index, self._in_flight.pop(index)))
            self._counters["produced"] -= len(indices)
            self._cond.notify_all()

    def _next_prompt(self) -> tuple[int, dict] | None:
        if self._retry:
            return self._retry.popleft()
        if self.prompts is None:
            raise RolloutBufferError("claim_prompts: this buffer has no prompt stream")
        item = self.prompts.next()
        if item is not None:
            self._counters["drawn"] += 1
        return item

    def _free_slots(self) -> int:
        return max(0, self.capacity - len(self._heap) - len(self._in_flight))

    def put_group(self, group: Group) -> bool:
        """Deliver the group of an in-flight prompt: True when buffered, False when dropped (and counted).

        A group is dropped as 'bad_reward' when a reward is not a finite number or beyond `max_abs_reward`,
        'invalid' when it has no response token, 'stale' when it is already too old for the trainer under the
        'drop' policy, and 'zero_variance' under dynamic sampling (module docstring). A group
        for a prompt that is not in flight, or a malformed group, raises RolloutBufferError.
        """
        try:
            group.check_structure()
        except ValueError as err:
            raise RolloutBufferError(f"put_group rejected: {err}") from err
        with self._cond:
            index = group.prompt_index
            if index not in self._in_flight:
                raise RolloutBufferError(f"put_group rejected: prompt {index} is not in flight ({self._where(index)})")
            problem = group.invalid_reason() or self._reward_problem(group)
            if problem is None:
                self._counters["groups_screened"] += 1
                self._counters["zero_variance_groups"] += int(_zero_variance(group))
            if problem is None and self._too_stale(group, self.trainer_version) and self.stale_policy == "drop":
                problem = ("stale", self._stale_detail(group, self.trainer_version))
            problem = problem or self._variance_problem(group)
            prompt = self._in_flight.pop(index)
            self._requeues.pop(index, None)
            if problem is not None:
                self._drop(index, *problem)
            else:
                group.metadata.setdefault("prompt", prompt)
                heapq.heappush(self._heap, (_order_version(group), self._arrivals, group))
                self._arrivals += 1
            self._cond.notify_all()
            return problem is None

    def put_groups(self, groups: list[Group]) -> list:
        """`put_group` for each of a driver burst's groups (one actor call, `rollout/burst.py`): per group True or
        False, or the RolloutBufferError that refused it (the others are put all the same)."""
        outcomes = []
        for group in groups:
            try:
                outcomes.append(self.put_group(group))
            except RolloutBufferError as err:
                outcomes.append(portable_error(err))
        return outcomes

    def requeue(self, prompt_index: int, reason: str = "") -> bool:
        """Give an in-flight prompt back (its engine died): it is generated again and still counted once.

        Returns True when requeued, False when the prompt exceeded `max_requeues` and was dropped
        ('requeue_limit').
        """
        with self._cond:
            if prompt_index not in self._in_flight:
                raise RolloutBufferError(
                    f"requeue: prompt {prompt_index} is not in flight ({self._where(prompt_index)})"
                )
            count = self._requeues.get(prompt_index, 0) + 1
            prompt = self._in_flight.pop(prompt_index)
            if count > self.max_requeues:
                self._requeues.pop(prompt_index, None)
                self._drop(prompt_index, "requeue_limit", f"requeued {count - 1} times already; last: {reason}")
                self._cond.notify_all()
                return False
            self._requeues[prompt_index] = count
            self._retry.append((prompt_index, prompt))
            self._counters["produced"] -= 1
            self._counters["requeued"] += 1
            self._cond.notify_all()
            return True

    def _where(self, index: int) -> str:
        """Why a prompt index is not in flight, for error messages."""
        if any(i == index for i, _ in self._retry):
            return "it was requeued and not claimed again"
        if any(g.prompt_index == index for _, _, g in self._heap):
            return "its group is already buffered"
        if index < 0 or self.prompts is None or index >= self.prompts.position:
            return "it was never handed out"
        return "its group was already consumed or dropped"

    def configure_lookahead(self, prompts_per_step: int, max_steps: int, target_idle: float = 0.05) -> int:
        """Size the driver's lookahead from the trainer's waits (`rollout/lookahead.py`), at most `max_steps`
        steps of `prompts_per_step` prompts; returns the starting lookahead in prompts. Without this call the
        driver runs its fixed lag ahead."""
        with self._cond:
            self.lookahead = Lookahead(prompts_per_step, max_steps * prompts_per_step, target_idle)
            return self.lookahead.prompts

    # ------------------------------------------------------------------------------------------------------------
    # Trainer side.

    def get_batch(
        self, num_groups: int, current_version: int, timeout_s: float = 0.0, allow_partial: bool = False
    ) -> list[Group]:
        """The `num_groups` oldest groups (oldest token first) for a trainer at `current_version`.

        Waits up to `timeout_s` for enough groups and returns [] if they do not come (nothing is consumed).
        Groups older than `max_staleness` are dropped first ('drop') or handed out with `stale=True`
        ('correct'). When no more groups can ever come (stream exhausted, nothing in flight), returns what is
        left if `allow_partial`, else [].
        """
        if not 1 <= num_groups <= self.capacity:
            raise RolloutBufferError(f"get_batch: num_groups={num_groups} must be in [1, capacity={self.capacity}]")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._asked is None or self._asked[0] != current_version:  # the trainer retries with short timeouts
                self._asked = (current_version, time.monotonic())
            self._advance_version(current_version)
            while len(self._heap) < num_groups and not self._finished():
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    break
                self._evict_stale(current_version)
            if len(self._heap) < num_groups and not (allow_partial and self._finished()):
                return []
            batch = [heapq.heappop(self._heap)[2] for _ in range(min(num_groups, len(self._heap)))]
            for group in batch:
                self._hand_out(group, current_version)
            self._observe_demand()
            self._zero_variance_drops = 0
            self._cond.notify_all()
            return batch

    def _observe_demand(self) -> None:
        """A batch was handed out: tell the lookahead how long the trainer waited for it, and in what cycle."""
        now = time.monotonic()
        wait = now - self._asked[1] if self._asked is not None else 0.0
        cycle = now - self._last_hand_out if self._last_hand_out is not None else None
        self._last_hand_out = now
        if self.lookahead is not None:
            self.lookahead.observe(wait, cycle)

    def set_trainer_version(self, version: int) -> None:
        """Tell the buffer the trainer's version: stale groups are dropped now (freeing slots for generation)."""
        with self._cond:
            self._advance_version(version)
            self._cond.notify_all()

    def _advance_version(self, version: int) -> None:
        self.trainer_version = max(self.trainer_version, version)
        if self._awaiting_trainer:
            self._gate_base = (self.trainer_version, self._counters["consumed"])
            self._awaiting_trainer = False
        self._evict_stale(version)

    def _hand_out(self, group: Group, current_version: int) -> None:
        staleness = group.staleness(current_version)
        group.stale = staleness > self.max_staleness
        self._counters["consumed"] += 1
        self._counters["consumed_twice"] += int(group.prompt_index in self._consumed)
        self._consumed.add(group.prompt_index)
        self._counters["corrected"] += int(group.stale)
        self._counters["staleness_sum"] += max(0, staleness)
        self._counters["staleness_max"] = max(self._counters["staleness_max"], staleness)

    def _too_stale(self, group: Group, version: int) -> bool:
        return group.staleness(version) > self.max_staleness

    def _stale_detail(self, group: Group, version: int) -> str:
        return f"oldest token version {group.min_version()} is {group.staleness(version)} behind trainer version {version} (max_staleness={self.max_staleness})"

    def _evict_stale(self, version: int) -> None:
        """Drop stale groups ('drop' policy); the heap is ordered oldest first, so they are on top."""
        if self.stale_policy != "drop":
            return
        evicted = False
        while self._heap and self._too_stale(self._heap[0][2], version):
            group = heapq.heappop(self._heap)[2]
            self._drop(group.prompt_index, "stale", self._stale_detail(group, version))
            evicted = True
        if evicted:  # slots freed: wake claimers waiting for space
            self._cond.notify_all()

    def _finished(self) -> bool:
        """No group can arrive any more: nothing in flight or to retry, and the stream is exhausted."""
        exhausted = self.prompts is None or self.prompts.exhausted
        return exhausted and not self._in_flight and not self._retry

    def _drop(self, index: int, reason: str, detail: str) -> None:
        self._dropped[reason] += 1
        self._drop_log.append({"prompt_index": index, "reason": reason, "detail": detail})

    # ------------------------------------------------------------------------------------------------------------
    # Accounting, stats, checkpoints.

    def check_accounting(self) -> dict[str, int]:
        """Assert produced == consumed + dropped + buffered + in_flight (and drawn == produced + retry_pending);
        return the counts."""
        with self._cond:
            counts = self._counts()
        if self._counters["consumed_twice"]:  # first: it also breaks the identity below, less tellingly
            raise AccountingError(f"{self._counters['consumed_twice']} prompt(s) were handed to the trainer twice")
        total = counts["consumed"] + counts["dropped"] + counts["buffered"] + counts["in_flight"]
        if counts["produced"] != total:
            raise AccountingError(
                f"produced {counts['produced']} != consumed + dropped + buffered + in_flight {total}: {counts}"
            )
        if counts["drawn"] != counts["produced"] + counts["retry_pending"]:
            raise AccountingError(f"drawn {counts['drawn']} != produced + retry_pending: {counts}")
        return counts

    def _counts(self) -> dict[str, int]:
        return {
            "drawn": self._counters["drawn"],
            "produced": self._counters["produced"],
            "in_flight": len(self._in_flight),
            "buffered": len(self._heap),
            "consumed": self._counters["consumed"],
            "dropped": sum(self._dropped.values()),
            "retry_pending": len(self._retry),
        }

    def stats(self) -> dict[str, Any]:
        """Counts, drops by reason (and the most recent ones), versions and staleness, for metrics."""
        with self._cond:
            versions = [v for v, _, _ in self._heap]
            consumed = self._counters["consumed"]
            return {
                **self._counts(),
                "dropped_by_reason": dict(self._dropped),
                "recent_drops": list(self._drop_log)[-10:],
                "requeued": self._counters["requeued"],
                "groups_screened": self._counters["groups_screened"],
                "zero_variance_groups": self._counters["zero_variance_groups"],
                "zero_variance_kept": self._counters["zero_variance_kept"],
                "corrected": self._counters["corrected"],
                "capacity": self.capacity,
                "free_slots": self._free_slots(),
                "trainer_version": self.trainer_version,
                "oldest_version": min(versions) if versions else None,
                "newest_version": max(versions) if versions else None,
                "mean_staleness": self._counters["staleness_sum"] / consumed if consumed else 0.0,
                "max_staleness_seen": self._counters["staleness_max"],
                "lookahead_prompts": self.lookahead.prompts if self.lookahead is not None else None,
                "data_position": self.prompts.position if self.prompts is not None else None,
                "finished": self._finished(),
            }

    def state_dict(self) -> dict[str, Any]:
        """Contents, counters and data position as plain JSON-able data."""
        with self._cond:
            ordered = sorted(self._heap, key=lambda item: item[:2])
            return {
                "format": STATE_FORMAT,
                "groups": [g.to_dict() for _, _, g in ordered],
                "in_flight": [[i, p] for i, p in self._in_flight.items()],
                "retry": [[i, p] for i, p in self._retry],
                "requeues": [[i, n] for i, n in self._requeues.items()],
                "counters": dict(self._counters),
                "dropped": dict(self._dropped),
                "drop_log": list(self._drop_log),
                "trainer_version": self.trainer_version,
                "gate_base": list(self._gate_base),
                "prompts": self.prompts.state_dict() if self.prompts is not None else None,
                "consumed": index_ranges(self._consumed),
            }

    def load_state_dict(self, state: dict[str, Any], requeue_in_flight: bool = True) -> None:
        """Restore a `state_dict`. Prompts that were in flight are requeued (their engines died with the run)
        unless `requeue_in_flight` is False (the same engines are still generating them); with new engines the
        gate stays shut until the trainer says its version (`_awaiting_trainer`)."""
        if state.get("format") != STATE_FORMAT:
            raise RolloutBufferError(f"load_state_dict: format {state.get('format')!r}, this code reads {STATE_FORMAT}")
        with self._cond:
            self._heap = []
            for arrival, data in enumerate(state["groups"]):
                group = Group.from_dict(data)
                self._heap.append((_order_version(group), arrival, group))
            heapq.heapify(self._heap)
            self._arrivals = len(self._heap)
            self._in_flight = {int(i): p for i, p in state["in_flight"]}
            self._retry = collections.deque((int(i), p) for i, p in state["retry"])
            self._requeues = {int(i): int(n) for i, n in state["requeues"]}
            self._counters = collections.Counter(state["counters"])
            self._dropped = collections.Counter(state["dropped"])
            self._drop_log = collections.deque(state.get("drop_log", []), maxlen=DROP_LOG_SIZE)
            self.trainer_version = int(state["trainer_version"])
            self._gate_base = tuple(int(n) for n in state.get("gate_base", (0, 0)))
            self._awaiting_trainer = requeue_in_flight
            # Older checkpoints lack it: the handed-out-twice check then covers this process only.
            self._consumed = indices_of_ranges(state.get("consumed", []))
            if state.get("prompts") is not None:
                if self.prompts is None:
                    raise RolloutBufferError(
                        "load_state_dict: the state has a data position but this buffer no prompt stream"
                    )
                self.prompts.load_state_dict(state["prompts"])
            if requeue_in_flight:
                self._retry.extend(sorted(self._in_flight.items()))
                self._counters["produced"] -= len(self._in_flight)
                self._in_flight = {}
            self._cond.notify_all()


def index_ranges(indices: set[int]) -> list[list[int]]:
    """Sorted indices as `[first, last]` runs: prompt indices are consumed nearly in order, so a checkpoint of a
    long run stores a few runs instead of every index."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def indices_of_ranges(runs: list[list[int]]) -> set[int]:
    """The set of indices that `index_ranges` wrote as runs."""
    return {i for first, last in runs for i in range(int(first), int(last) + 1)}


def _zero_variance(group: Group) -> bool:
    """Whether every sample of the group has the same reward (group-relative advantages are then all 0)."""
    return len({s.reward for s in group.samples}) == 1


def _order_version(group: Group) -> int:
    """Sort key of a group: its oldest token version (a group without tokens never reaches the heap)."""
    oldest = group.min_version()
    return 0 if oldest is None else oldest


def make_buffer_actor(*args: Any, name: str | None = None, max_concurrency: int = 64, **kwargs: Any):
    """Start a `RolloutBuffer` as a threaded Ray actor (arguments as for `RolloutBuffer`); returns its handle.

    Ray runs up to `max_concurrency` calls at once on a thread pool; the buffer's lock makes each atomic.
    `claim_prompts`/`get_batch` block a thread while they wait, so keep fewer waiting callers than threads.
    """

    options: dict[str, Any] = {"max_concurrency": max_concurrency, "num_cpus": 0, **on_this_node()}
    if name:
        options["name"] = name
    return ray.remote(RolloutBuffer).options(**options).remote(*args, **kwargs)
