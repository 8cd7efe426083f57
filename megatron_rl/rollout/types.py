"""Typed structs that cross process boundaries on the generation side: one `Sample` (a response with its
behaviour logprobs and the weight version of every token) and one `Group` (the samples of one prompt); what the
driver asks an engine for and gets back (`GenerationRequest`, `GenerationResult`); and the error of a task, its
data or its rewards (`TaskError`).

Both are plain dataclasses of JSON-able fields: Ray ships them between actors, and `to_dict`/`from_dict` give the
JSON form that buffer checkpoints hold (never a pickle).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import uuid
from typing import Any

from megatron_rl.errors import UserError


class TaskError(UserError, ValueError):
    """A task cannot be built or used; the message names the file, row, column, field or dotted path at fault."""


@dataclasses.dataclass
class Sample:
    """One generated response to one prompt."""

    prompt_ids: list[int]
    """Token ids of the prompt."""
    response_ids: list[int]
    """Token ids of the response (EOS included when the engine stopped on it)."""
    logprobs: list[float]
    """Behaviour-policy logprob of every response token, as the engine sampled it."""
    versions: list[int]
    """Weight version that produced every response token (a partial rollout spans versions)."""
    reward: float = 0.0
    """Scalar reward of the whole response (NaN when the reward function failed)."""
    group_id: str = ""
    """Identifier shared by the samples of one prompt (empty: the prompt index)."""
    prompt_index: int = -1
    """Data position of the prompt (what the buffer's `claim_prompts` handed out)."""
    finish_reason: str = "length"
    """Why generation stopped: 'stop' (EOS or a stop token), 'length' (max tokens), 'abort'."""
    engine: str = ""
    """Name of the engine that generated it."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of every response token given the prompt and the response
    before it (untempered: vLLM prompt logprobs); None without a teacher."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form JSON-able extras: `rewards` ({component: value}: each reward function's value and each length
    penalty, for the `reward/<name>` metrics), `reward_error`, `reward_info` (a verl reward's extra entries),
    `routes` (routed experts), `kept_sets` (the sampler's kept token sets), ..."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"sample of prompt {self.prompt_index}: {n} response tokens but {len(self.logprobs)} logprobs "
                f"and {len(self.versions)} versions (one of each per token)"
            )
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(
                f"sample of prompt {self.prompt_index}: {n} response tokens but {len(self.teacher_logprobs)} teacher"
                " logprobs (one per token)"
            )

    @property
    def num_tokens(self) -> int:
        """Number of response tokens."""
        return len(self.response_ids)

    def min_version(self) -> int | None:
        """Oldest weight version among the response tokens (None for an empty response)."""
        return min(self.versions) if self.versions else None

    def max_version(self) -> int | None:
        """Newest weight version among the response tokens (None for an empty response)."""
        return max(self.versions) if self.versions else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (lists and scalars only)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of `to_dict`; unknown keys are an error (they mean a format mismatch)."""
        return cls(**data)

    @classmethod
    def from_generation(
        cls, result: Any, prompt_index: int, reward: float = 0.0, group_id: str = "", **metadata: Any
    ) -> Sample:
        """Build a sample from an engine's `GenerationResult` (duck-typed: no engine import here)."""
        return cls(
            prompt_ids=list(result.prompt_ids),
            response_ids=list(result.token_ids),
            logprobs=list(result.logprobs),
            versions=list(result.versions),
            reward=reward,
            group_id=group_id,
            prompt_index=prompt_index,
            finish_reason=result.finish_reason,
            engine=result.engine,
            metadata=dict(metadata)
            | ({"routes": result.routes} if getattr(result, "routes", None) else {})
            | ({"kept_sets": result.kept_sets} if getattr(result, "kept_sets", None) else {}),
        )


@dataclasses.dataclass
class Group:
    """The samples of one prompt: the unit the buffer stores and group-relative advantages normalise over."""

    prompt_index: int
    """Data position of the prompt."""
    samples: list[Sample]
    """The responses (samples_per_prompt of them)."""
    stale: bool = False
    """Set by the buffer when it hands the group out beyond `max_staleness` under the 'correct' policy."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form JSON-able extras (the prompt record, the answer, ...)."""

    @property
    def group_id(self) -> str:
        """The samples' group id, or the prompt index when they carry none."""
        return self.samples[0].group_id if self.samples and self.samples[0].group_id else str(self.prompt_index)

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.samples)

    @property
    def rewards(self) -> list[float]:
        """Reward of every sample."""
        return [s.reward for s in self.samples]

    @property
    def num_tokens(self) -> int:
        """Response tokens over all samples."""
        return sum(s.num_tokens for s in self.samples)

    def min_version(self) -> int | None:
        """Oldest weight version of any token in the group (None when no sample has a token)."""
        versions = [v for s in self.samples if (v := s.min_version()) is not None]
        return min(versions) if versions else None

    def max_version(self) -> int | None:
        """Newest weight version of any token in the group (None when no sample has a token)."""
        versions = [v for s in self.samples if (v := s.max_version()) is not None]
        return max(versions) if versions else None

    def staleness(self, current_version: int) -> int:
        """How many versions the oldest token lags the trainer: `current_version - min_version` (0 if empty)."""
        oldest = self.min_version()
        return 0 if oldest is None else current_version - oldest

    def check_structure(self) -> None:
        """Raise ValueError when the group is malformed (a caller bug, not a data problem)."""
        if not self.samples:
            raise ValueError(f"group of prompt {self.prompt_index} has no samples")
        for i, sample in enumerate(self.samples):
            if not isinstance(sample, Sample):
                raise ValueError(f"group of prompt {self.prompt_index}: sample {i} is a {type(sample).__name__}")
            if sample.prompt_index != self.prompt_index:
                raise ValueError(
                    f"group of prompt {self.prompt_index}: sample {i} belongs to prompt {sample.prompt_index}"
                )
        ids = {s.group_id for s in self.samples}
        if len(ids) > 1:
            raise ValueError(f"group of prompt {self.prompt_index}: samples carry different group ids {sorted(ids)}")

    def invalid_reason(self) -> tuple[str, str] | None:
        """(drop reason, detail) when the group's content cannot be trained on, else None.

        A non-finite reward invalidates the whole group ('bad_reward'): a substitute value would skew the group's
        advantages. A group without a single response token is 'invalid'.
        """
        for i, sample in enumerate(self.samples):
            reward = sample.reward
            if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                error = sample.metadata.get("reward_error", "")
                return "bad_reward", f"sample {i} reward {reward!r}" + (f" ({error})" if error else "")
        if self.num_tokens == 0:
            return "invalid", "no sample has a response token"
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "prompt_index": self.prompt_index,
            "samples": [s.to_dict() for s in self.samples],
            "stale": self.stale,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Group:
        """Inverse of `to_dict`."""
        return cls(
            prompt_index=int(data["prompt_index"]),
            samples=[Sample.from_dict(s) for s in data["samples"]],
            stale=bool(data.get("stale", False)),
            metadata=dict(data.get("metadata", {})),
        )


@dataclasses.dataclass
class GenerationRequest:
    """One sample to generate: prompt token ids and sampling settings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """Keep the top_k most likely tokens (after the temperature); -1: off."""
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    """Per-request sampling seed: the same seed and weights give the same response whatever else the engine is
    running (what makes a resumed run repeat the uninterrupted one); None samples from the engine's stream."""
    return_kept_sets: bool = False
    """Return the token set the top-k / top-p sampler kept at every response position (`GenerationResult.
    kept_sets`), so the trainer masks its logits to that very set. Needs `top_k` (it bounds the set): the engine
    asks vLLM for top_k + 1 processed logprobs, -inf outside the set."""

    def __post_init__(self):
        if self.return_kept_sets and self.top_k < 1:
            raise ValueError(
                f"request {self.request_id}: return_kept_sets needs top_k >= 1 (it bounds the kept set), got {self.top_k}"
            )


@dataclasses.dataclass
class GenerationResult:
    """What came back: the response tokens, each one's logprob and the weight version that produced it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    engine: str
    continuations: int = 0
    """How many times the request was aborted (by a weight update) and continued from its prefix."""
    routes: dict | None = None
    """With `EngineSpec.capture_routes`: the experts every MoE layer chose for positions 0 .. P+T-2 of prompt +
    response (the last token was never fed back), stitched across continuations (`models/routes.encode_routes`)."""
    kept_sets: dict | None = None
    """With `GenerationRequest.return_kept_sets`: every response token's kept set `[tokens, top_k]` int32 across
    continuations (`models/routes.encode_kept_sets`, `kept_set_row`)."""
