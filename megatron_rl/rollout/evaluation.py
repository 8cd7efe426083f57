"""Evaluation during training: the validation prompts through the same engines, greedy and sampled.

Every `eval.interval` steps (once the trainer's version reaches the next multiple) and after the last step, the
launcher runs one evaluation beside generation: each validation prompt once greedily (`eval/reward_mean`) and
`eval.n` times at the rollout temperature with fixed seeds (`eval/pass@k`, `eval/mean@k`). Each result says
which weight versions produced its tokens (`eval/version_min`, `eval/version_max`): an update that lands during
the evaluation shows there. It costs the generation it needs and nothing else: the trainer does not wait for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.pass_at_k import eval_scores

log = logging.getLogger(__name__)

EVAL_SEED = 7_777_777
"""Base of the sampled evaluation's seeds: the same prompts get the same seeds at every evaluation."""

ScoreGroup = Callable[[list[str], dict], Awaitable[list[float]]]
"""(decoded responses of one prompt, its record) -> their rewards."""


class Evaluator:
    """Runs evaluations on the engines the driver routes to (see the module docstring)."""

    def __init__(
        self, engines: dict, down: dict, prompts: Sequence[dict], tokenizer, score: ScoreGroup, eval_cfg, rollout
    ):
        """`engines`/`down`: the driver's live routing tables (restarted engines appear there); `prompts`: the
        validation records (`prompt_ids`, `answer`, ...); `eval_cfg`: the `eval` config section; `rollout`: the
        rollout section (response length, temperature)."""
        self.engines, self.down, self.prompts = engines, down, list(prompts)
        self.tokenizer, self.score, self.cfg, self.rollout = tokenizer, score, eval_cfg, rollout
        self.done: list[dict] = []

    def due(self, trainer_version: int, last_evaluated: int | None, last_step: int) -> bool:
        """Whether an evaluation is due at `trainer_version`: it reached a multiple of the interval that the last
        evaluation did not (the launcher looks twice a second, and a fast trainer passes a multiple in between,
        or while an evaluation still runs), or it is the last step."""
        interval = self.cfg.interval
        if not interval or not self.prompts or trainer_version == 0 or trainer_version == last_evaluated:
            return False
        return trainer_version // interval > (last_evaluated or 0) // interval or trainer_version == last_step

    async def evaluate(self, version: int) -> dict:
        """One evaluation, tagged with the trainer `version` that asked for it; returns its `eval/*` metrics."""
        start = time.perf_counter()
        limit = asyncio.Semaphore(max(1, self.cfg.max_concurrent_requests))
        greedy = [self._request(p, 0.0, None) for p in self.prompts]
        sampled = [
            self._request(p, self.rollout.temperature, EVAL_SEED + i * 4096 + s)
            for i, p in enumerate(self.prompts)
            for s in range(self.cfg.n)
        ]
        results = await asyncio.gather(*(self._generate(r, j, limit) for j, r in enumerate(greedy + sampled)))
        texts = [self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
        greedy_rewards = [(await self.score([texts[i]], record))[0] for i, record in enumerate(self.prompts)]
        n, offset = self.cfg.n, len(self.prompts)
        sampled_rewards = [
            await self.score(texts[offset + i * n : offset + (i + 1) * n], record)
            for i, record in enumerate(self.prompts)
        ]
        versions = [v for r in results for v in r.versions] or [version]
        metrics = {
            "eval/version": version,
            "eval/version_min": min(versions),
            "eval/version_max": max(versions),
            "eval/prompts": len(self.prompts),
            "eval/reward_mean": sum(greedy_rewards) / len(greedy_rewards),
            **eval_scores(sampled_rewards, self.cfg.pass_threshold),
            "eval/seconds": time.perf_counter() - start,
        }
        self.done.append(metrics)
        return metrics

    def _request(self, record: dict, temperature: float, seed: int | None) -> GenerationRequest:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return GenerationRequest(
            prompt_ids=list(record["prompt_ids"]), max_tokens=self.rollout.max_new_tokens, temperature=temperature,
            stop_token_ids=[eos] if eos is not None else [], seed=seed,
        )  # fmt: skip

    async def _generate(self, request: GenerationRequest, index: int, limit: asyncio.Semaphore):
        """One request on an engine that is up (round robin by index), within the request timeout."""
        async with limit:
            live = [name for name in self.engines if name not in self.down] or list(self.engines)
            actor = self.engines[live[index % len(live)]]
            return await asyncio.wait_for(actor.generate.remote(request), self.rollout.request_timeout_s)


class EvalRunner:
    """Starts the evaluations that fall due while the launcher drives generation, and appends each result as one
    JSON line to `RUN_DIR/eval.jsonl`, from where trainer rank 0 merges it into the step record it writes next
    (the last step's record waits for the last evaluation)."""

    def __init__(self, evaluator: Evaluator, path: Path, last_step: int, timeout_s: float, say=None):
        self.evaluator, self.path, self.last_step, self.timeout_s = evaluator, Path(path), last_step, timeout_s
        self.say = say or (lambda text: None)
        self.last: int | None = None
        self.task: asyncio.Task | None = None

    def poll(self, trainer_version: int) -> None:
        """(In the launcher's event loop) start an evaluation when one is due and none is running."""
        if self.task is not None and not self.task.done():
            return
        if self.evaluator.due(trainer_version, self.last, self.last_step):
            self.last = trainer_version
            self.task = asyncio.get_running_loop().create_task(self._run(trainer_version))

    async def _run(self, version: int) -> None:
        try:
            metrics = await asyncio.wait_for(self.evaluator.evaluate(version), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # an evaluation lost to an engine failure or the deadline; training goes on
            log.warning("evaluation at version %d failed: %s: %s", version, type(err).__name__, err)
            metrics = {"eval/version": version, "eval/failed": f"{type(err).__name__}: {err}"[:300]}
        with self.path.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        if "eval/reward_mean" in metrics:
            k = max(int(key.split("@")[1]) for key in metrics if key.startswith("eval/pass@"))
            self.say(
                f"eval at version {version}: reward {metrics['eval/reward_mean']:.3f} | pass@1 "
                f"{metrics['eval/pass@1']:.3f} | pass@{k} {metrics[f'eval/pass@{k}']:.3f} | mean@{k} "
                f"{metrics[f'eval/mean@{k}']:.3f} ({metrics['eval/prompts']} prompts, {metrics['eval/seconds']:.1f} s)"
            )


def generated_eval_prompts(task, count: int) -> list[dict]:
    """Held-out prompts of a generated (built-in) task: its `count` first prompts of an epoch training never
    reaches (-1), the same at every evaluation."""
    prompts = task.prompts(epoch=-1)
    return [next(prompts) for _ in range(count)]
