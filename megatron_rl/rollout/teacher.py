"""On-policy distillation, rollout side: the teacher engines that score what the student generates.

The teacher is a Hugging Face checkpoint served by its own engine pool (`distill.teacher: hf`): vLLM engines like
the student's, never synced; or (`distill.teacher: snapshot`) such a pool started from the policy's checkpoint that
the trainer refreshes with its weights every `distill.refresh_every` steps (`weights/snapshot.py`). The generation
driver hands each group to `TeacherScorer.score` while its rewards are computed; the scorer asks the least busy
live teacher for the prompt logprobs of every sample's prompt + response (`VLLMEngine.score_versioned`,
prompt_logprobs=0: the logprob of each token given its prefix, untempered) and stores the response tokens' ones on
the sample (`Sample.teacher_logprobs`), with the call's latency and the teacher's weight version in
`sample.metadata`.

A scoring that fails (timeout, engine error, a dead teacher, a non-finite logprob) raises `TeacherError`: the
driver requeues the prompt as it does after a failed generation, so no sample is lost. A teacher whose actor died,
or that timed out and then answers no health call (hung), is restarted from its checkpoint, up to
`rollout.max_engine_restarts` times; past that the run stops (GenerationError). A restarted teacher scores again
only once it holds at least the weight version it last scored with (a snapshot teacher starts from the policy's
checkpoint and waits for the trainer's refresh, which a restart brings forward; a fixed teacher is always there).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megatron_rl.config import RunConfig
from megatron_rl.errors import UserError
from megatron_rl.models.routes import encode_teacher_top
from megatron_rl.rollout.driver import GenerationError, TeacherError, ask_health, error_line, is_actor_death
from megatron_rl.rollout.engine import EngineSpec
from megatron_rl.rollout.tasks import load_tokenizer
from megatron_rl.rollout.types import Sample

log = logging.getLogger(__name__)

LATENCY_KEY = "teacher_latency_s"
"""`sample.metadata` key of the teacher call's seconds (the `distill/teacher_latency_s` metric)."""
TOP_KEY = "teacher_top"
"""`sample.metadata` key of the teacher's top-k ids and logprobs at each response token (`distill.loss: topk_*`;
`models/routes.encode_teacher_top`)."""
VERSION_KEY = "teacher_version"
"""`sample.metadata` key of the teacher's weight version that scored the sample (`distill/teacher_version`)."""
WAIT_POLL_S = 0.2
"""How often a scoring that finds every teacher down looks for a restarted one."""
PROBE_TIMEOUT_S = 10.0
"""How long a teacher whose scoring timed out gets to answer a health call before it is taken as hung."""


class TeacherMismatchError(UserError, ValueError):
    """The teacher cannot teach this student (missing checkpoint, another tokenizer); the message names both."""


def check_teacher(student_path: str, teacher_path: str) -> None:
    """TeacherMismatchError unless `teacher_path` is a checkpoint whose tokenizer is the student's: the teacher
    scores the student's token ids, which mean the same text only under the same vocabulary and special tokens."""
    if not (Path(teacher_path) / "config.json").exists():
        raise TeacherMismatchError(
            f"distill.teacher_path={teacher_path!r}: no config.json there (a Hugging Face checkpoint folder, e.g. the"
            " RUN_DIR/hf that an RL run exports at its end)"
        )
    student, teacher = load_tokenizer(student_path), load_tokenizer(teacher_path)
    differences = tokenizer_differences(student, teacher)
    if differences:
        raise TeacherMismatchError(
            f"the teacher's tokenizer ({teacher_path}) differs from the student's ({student_path}): "
            + "; ".join(differences)
            + ". On-policy distillation scores the student's token ids with the teacher, which needs one tokenizer"
        )


def tokenizer_differences(student, teacher) -> list[str]:
    """What differs between two tokenizers: the vocabulary (token -> id) and the special tokens' ids."""
    found = []
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours != theirs:
        changed = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
        found.append(
            f"vocabularies of {len(ours)} and {len(theirs)} tokens differ at {len(changed)} token(s), e.g. "
            + ", ".join(f"{t!r}: {ours.get(t)} vs {theirs.get(t)}" for t in changed[:3])
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            found.append(f"{name} {getattr(student, name, None)} vs {getattr(teacher, name, None)}")
    return found


def teacher_specs(cfg: RunConfig) -> list[EngineSpec]:
    """One EngineSpec per teacher engine (`distill`): the teacher checkpoint (a snapshot teacher: the policy's,
    `model.hf_path`), one token longer than the student's sequences (scoring a whole prompt + response asks vLLM
    for one more token)."""
    d, r = cfg.distill, cfg.rollout
    path = d.teacher_path if d.teacher == "hf" else cfg.model.hf_path
    return [
        EngineSpec(
            name=f"teacher-{i}", model_path=path, dtype=d.teacher_dtype or cfg.model.dtype,
            tensor_parallel=d.engine_tp, max_model_len=cfg.model.max_sequence_length + 1,
            cpu_kv_cache_gb=d.cpu_kv_cache_gb, seed=cfg.trainer.seed + 1000 + i, max_logprobs=max(20, d.top_k),
            max_num_seqs=max(16, r.num_engines * r.max_concurrent_prompts * r.samples_per_prompt),
            gpu_memory_utilization=r.gpu_memory_utilization, cpu_affinity=list(r.cpu_affinity),
            cpu_batch_scheduling=r.cpu_batch_scheduling, enforce_eager=r.enforce_eager,
            engine_core_in_process=r.engine_core_in_process,
        )
        for i in range(d.num_engines)
    ]  # fmt: skip


def response_logprobs(sample: Sample, scored: list[float]) -> list[float]:
    """The response tokens' logprobs out of the scores of `prompt + response` (entry j is token j + 1's)."""
    n = len(sample.response_ids)
    expected = len(sample.prompt_ids) + n - 1
    if len(scored) != expected:
        raise TeacherError(f"prompt {sample.prompt_index}: the teacher returned {len(scored)} logprobs, not {expected}")
    mine = [float(x) for x in scored[len(scored) - n :]] if n else []
    bad = next((i for i, x in enumerate(mine) if not math.isfinite(x)), None)
    if bad is not None:
        raise TeacherError(
            f"prompt {sample.prompt_index}: the teacher's logprob of response token {bad} is {mine[bad]}"
        )
    return mine


def response_top(sample: Sample, rows: list) -> dict:
    """The response tokens' top-k rows (`(ids, logprobs)` per scored position, entry j is token j + 1's), encoded
    for the sample (`models/routes.encode_teacher_top`)."""
    n = len(sample.response_ids)
    mine = rows[len(rows) - n :] if n else []
    ids = np.array([r[0] for r in mine], dtype=np.int32).reshape(n, -1)
    logprobs = np.array([r[1] for r in mine], dtype=np.float32).reshape(n, -1)
    if not np.isfinite(logprobs).all():
        raise TeacherError(f"prompt {sample.prompt_index}: the teacher's top-k logprobs are not all finite")
    return encode_teacher_top(ids, logprobs)


class TeacherScorer:
    """Scores groups on the teacher engines (module docstring); every call is bounded by `timeout_s`."""

    def __init__(
        self,
        actors: dict[str, object],
        restart: Callable[[str], object],
        timeout_s: float,
        max_restarts: int,
        refresh_wait_s: float = 600.0,
        top_k: int = 0,
    ):
        self.actors = dict(actors)
        self._restart_blocking = restart
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.busy = dict.fromkeys(self.actors, 0)
        self.down: dict[str, str] = {}
        self.restarts: dict[str, int] = {}
        self.failures = 0
        self._restarting: dict[str, asyncio.Task] = {}
        self.fatal: BaseException | None = None
        self.versions = dict.fromkeys(self.actors, 0)
        """The weight version each teacher last scored with."""
        self.refresh_wait_s = refresh_wait_s
        self.top_k = top_k
        """Ask for each position's top k too (a top-k distillation loss); 0: the scored tokens' logprobs only."""
        """How long a restarted teacher may wait for the weights it held (the trainer's refresh) before the run
        stops."""

    async def score(self, samples: list[Sample]) -> float:
        """Set `teacher_logprobs` (and the latency) on every sample of one group; returns the seconds it took.

        TeacherError when the scoring failed (the caller requeues the prompt); GenerationError when a teacher
        died more often than allowed (the run cannot go on)."""
        start = time.perf_counter()
        name = await self._a_live_teacher()
        actor = self.actors[name]  # a late failure of a replaced actor says nothing of its successor
        self.busy[name] += 1
        try:
            sequences = [s.prompt_ids + s.response_ids for s in samples]
            scored = await asyncio.wait_for(actor.score_versioned.remote(sequences, self.top_k), self.timeout_s)
        except asyncio.TimeoutError:
            self.failures += 1
            await self._check_hung(name, actor)
            raise TeacherError(f"{name} did not score within distill.request_timeout_s={self.timeout_s:g} s") from None
        except Exception as err:
            self.failures += 1
            if is_actor_death(err) and self.actors[name] is actor:
                self._mark_down(name, error_line(err))
            raise TeacherError(f"{name}: {error_line(err)}") from err
        finally:
            self.busy[name] -= 1
        values = [response_logprobs(s, scores) for s, scores in zip(samples, scored["logprobs"], strict=True)]
        seconds = time.perf_counter() - start
        if self.actors[name] is actor:
            self.versions[name] = max(self.versions.get(name, 0), scored["version"])
        for sample, mine in zip(samples, values):
            sample.teacher_logprobs = mine
            sample.metadata[LATENCY_KEY] = seconds
            sample.metadata[VERSION_KEY] = scored["version"]
        for sample, rows in zip(samples, scored.get("top") or [], strict=False):
            sample.metadata[TOP_KEY] = response_top(sample, rows)
        return seconds

    async def _a_live_teacher(self) -> str:
        """The least busy teacher that is up; waits (at most `timeout_s`) while every one is being restarted."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.fatal is not None:
                raise GenerationError(f"the teacher cannot go on: {self.fatal}") from self.fatal
            live = [n for n in self.actors if n not in self.down]
            if live:
                return min(live, key=lambda n: self.busy[n])
            if time.monotonic() > deadline:
                raise TeacherError(f"every teacher engine is down ({self.down}) for {self.timeout_s:g} s")
            await asyncio.sleep(WAIT_POLL_S)

    async def _check_hung(self, name: str, actor) -> None:
        """After a scoring on `actor` timed out: a teacher that is dead, or answers no health call within
        `PROBE_TIMEOUT_S` (alive but stuck), is restarted; a slow but healthy one goes on."""
        health, dead = await ask_health(actor, PROBE_TIMEOUT_S)
        if dead is None and not health:
            dead = f"hung: a scoring timed out and the health call got no answer within {PROBE_TIMEOUT_S:g} s"
        if dead is not None and self.actors[name] is actor:
            self._mark_down(name, dead)

    def _mark_down(self, name: str, reason: str) -> None:
        """Route nothing to `name` and restart it in the background (once, whatever the calls that saw it die)."""
        if name in self.down:
            return
        self.down[name] = reason
        count = self.restarts.get(name, 0)
        if count >= self.max_restarts:
            self.fatal = GenerationError(
                f"{name} is down ({reason}) after {count} restart(s) (rollout.max_engine_restarts={self.max_restarts})"
            )
            return
        self.restarts[name] = count + 1
        log.warning("teacher %s is down (%s): restarting it (restart %d)", name, reason, count + 1)
        self._restarting[name] = asyncio.get_running_loop().create_task(self._restart(name))

    async def _restart(self, name: str) -> None:
        try:
            actor = await asyncio.get_running_loop().run_in_executor(None, self._restart_blocking, name)
            self.actors[name] = actor  # the trainer finds it by name and refreshes it (a snapshot teacher)
            await self._await_version(name, actor, self.versions.get(name, 0))
        except Exception as err:
            self.fatal = GenerationError(f"restarting teacher {name} failed: {error_line(err)}")
            return
        self.down.pop(name, None)
        log.warning("teacher %s is back", name)

    async def _await_version(self, name: str, actor, version: int) -> None:
        """Wait until the restarted `actor` holds weights of at least `version` (those it scored with before);
        TimeoutError past `refresh_wait_s`."""
        deadline = time.monotonic() + self.refresh_wait_s
        while version > 0:
            held = await asyncio.wait_for(actor.weight_version.remote(), PROBE_TIMEOUT_S)
            if held >= version:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name} restarted at weight version {held}, and the trainer did not bring it to version"
                    f" {version} within {self.refresh_wait_s:.0f} s"
                )
            await asyncio.sleep(WAIT_POLL_S)

    def report(self) -> dict:
        """The teacher side's counters for the run's summary."""
        return {"failures": self.failures, "restarts": dict(self.restarts), "down": dict(self.down)}
