"""The on-policy distillation section: the teacher that scores what the student generates, and how its score
enters the per-token advantage (docs/algorithms.md, "On-policy distillation")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Section


class DistillConfig(Section):
    """On-policy distillation: a teacher scores every response token; the trainer learns from that score.

    Each response token y_t gets the advantage `use_reward * A_reward - kl_coef * (log p_student(y_t) -
    log p_teacher(y_t))`, both logprobs of the untempered (temperature 1), untruncated distributions, under the
    same decoupled / importance-sampling correction as the RL loss."""

    teacher: Literal["none", "hf", "snapshot"] = "none"
    """Where the teacher comes from: `none` (no distillation), `hf` (the Hugging Face checkpoint at
    `teacher_path`, served by its own engine pool), or `snapshot` (self-distillation: teacher engines that start
    from the policy's checkpoint and get the trainer's weights every `refresh_every` steps through the weight
    sync, frozen in between)."""
    teacher_path: str = ""
    """Folder of the teacher's Hugging Face checkpoint (`teacher: hf`); its tokenizer must be the student's."""
    teacher_dtype: Literal["float32", "bfloat16"] | None = None
    """Serving dtype of the teacher engines (empty: `model.dtype`)."""
    num_engines: int = Field(1, ge=1)
    """Teacher engine actors (each scores whole groups; a group goes to the least busy one)."""
    engine_tp: int = Field(1, ge=1)
    """Tensor parallel size of each teacher engine."""
    cpu_kv_cache_gb: int = Field(1, ge=1)
    """KV cache size of a CPU teacher engine (VLLM_CPU_KVCACHE_SPACE)."""
    kl_coef: float = Field(1.0, ge=0)
    """lambda: the weight of the distillation term: the per-token reverse-KL advantage `-(log p_student -
    log p_teacher)` (`loss: advantage`), or the top-k KL loss term (`loss: topk_*`)."""
    loss: Literal["advantage", "topk_forward_kl", "topk_reverse_kl"] = "advantage"
    """How the teacher's score trains the student: `advantage` (the sampled token's reverse-KL estimate as a
    per-token advantage, under the policy loss and its correction; tinker-cookbook, slime), or a loss term over
    the teacher's `top_k` tokens at every response position, both distributions renormalised on them:
    `topk_forward_kl` KL(teacher || student) or `topk_reverse_kl` KL(student || teacher) (NeMo-RL's top-k
    distillation), added to the policy loss (whose advantages are then the reward's alone)."""
    top_k: int = Field(20, ge=1, le=256)
    """The teacher tokens per position the `topk_*` losses compare on (the teacher engines' `max_logprobs`
    follows)."""
    use_reward: bool = True
    """Add the task reward's advantage to the distillation term; false: pure distillation (the reward is still
    computed and logged, `reward/mean`, but trains nothing)."""
    refresh_every: int = Field(0, ge=0)
    """`teacher: snapshot` only: copy the policy into the teacher engines after every this many steps (0: never,
    the teacher stays the starting policy). A restarted teacher gets the current policy at the next step."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Longest the teacher may take to score one group; past it the scoring failed and the prompt is requeued."""

    @property
    def enabled(self) -> bool:
        """Whether the run distils from a teacher."""
        return self.teacher != "none"

    @property
    def top_loss(self) -> str:
        """`forward` or `reverse` with a top-k KL loss, else empty."""
        return self.loss.removeprefix("topk_").removesuffix("_kl") if self.enabled and self.loss != "advantage" else ""

    @model_validator(mode="after")
    def _teacher_complete(self) -> DistillConfig:
        if self.teacher == "snapshot" and self.teacher_path:
            raise ValueError(
                f"distill.teacher=snapshot copies the policy into the teacher engines, so distill.teacher_path="
                f"{self.teacher_path!r} has no use: leave it empty, or set distill.teacher=hf to distil from it"
            )
        if self.teacher == "hf" and not self.teacher_path:
            raise ValueError("distill.teacher=hf needs distill.teacher_path (the teacher's Hugging Face checkpoint)")
        if self.teacher == "none" and self.teacher_path:
            raise ValueError(
                f"distill.teacher_path={self.teacher_path!r} is set but distill.teacher=none: set distill.teacher=hf"
                " to distil from it, or leave teacher_path empty"
            )
        if self.refresh_every and self.teacher != "snapshot":
            raise ValueError(f"distill.refresh_every={self.refresh_every} applies to distill.teacher=snapshot only")
        if self.enabled and not self.use_reward and self.kl_coef == 0:
            raise ValueError("distill.use_reward=false with distill.kl_coef=0 leaves nothing to train on")
        return self
