"""The plan of a run config, and its JSON and text renderings (GB = 10^9 bytes, billions of parameters)."""

from __future__ import annotations

import dataclasses

from megatron_rl.planner.common import GB
from megatron_rl.planner.engines import EnginePlan
from megatron_rl.planner.lora import LoraPlan
from megatron_rl.planner.params import ModelSize
from megatron_rl.planner.trainer import StageMemory, TrainerPlan


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run config planned against its cluster."""

    name: str
    """Run name."""
    family: str
    """Model family."""
    model_source: str
    """Where the model shape came from (a config.json path, or `tiny <family>`)."""
    size: ModelSize
    """Parameter counts."""
    gpu: str
    """GPU type."""
    trainer_gpus: int
    """GPUs of the trainer."""
    inference_gpus: int
    """GPUs of the engines."""
    trainer: TrainerPlan
    """Trainer memory."""
    engines: EnginePlan
    """Engine memory."""
    lora: LoraPlan | None = None
    """The adapters (with `lora.rank` > 0)."""
    teachers: EnginePlan | None = None
    """The teacher engines (on-policy distillation); their GPUs are in `inference_gpus`."""
    teacher_source: str = ""
    """Where the teacher's shape came from (a config.json path, or the policy's)."""

    def to_dict(self) -> dict:
        """A JSON-ready summary in GB (10^9 bytes) and billions of parameters."""
        worst = self.trainer.worst
        lora = {} if self.lora is None else {"lora": lora_dict(self.lora)}
        teachers = {}
        if self.teachers is not None:
            teachers = {"teachers": engines_dict(self.teachers) | {"shape_from": self.teacher_source}}
        return (
            {
                "name": self.name,
                "family": self.family,
                "model_source": self.model_source,
                "params_b": {
                    "total": _b(self.size.total),
                    "active": _b(self.size.active),
                    "expert": _b(self.size.expert),
                },
                "gpu": self.gpu,
                "gpu_memory_gb": gb(self.trainer.gpu_memory_bytes),
                "trainer": {
                    "gpus": self.trainer_gpus,
                    "layout": self.trainer.layout,
                    "stage_layers": self.trainer.stage_layers,
                    "microbatches": self.trainer.microbatches,
                    "tokens_per_microbatch": self.trainer.tokens_per_microbatch,
                    "worst_stage": worst.stage,
                    "per_gpu_gb": stage_gb(worst),
                    "stages_total_gb": [gb(s.total_bytes) for s in self.trainer.stages],
                },
                "inference": {"gpus": self.inference_gpus, **engines_dict(self.engines)},
            }
            | lora
            | teachers
        )


def engines_dict(e: EnginePlan) -> dict:
    """One engine pool's part of a plan, per GPU in GB."""
    return {
        "engines": e.num_engines,
        "gpus_per_engine": e.gpus_per_engine,
        "per_gpu_gb": {
            "weights": gb(e.weight_bytes),
            "overhead": gb(e.overhead_bytes),
            "kv_cache": gb(e.kv_cache_bytes),
            "budget": gb(e.budget_bytes),
        },
        "kv_bytes_per_token": e.kv_bytes_per_token,
        "kv_cache_tokens_per_replica": e.kv_cache_tokens,
        "max_sequences_per_replica": e.max_sequences,
    }


def lora_dict(p: LoraPlan) -> dict:
    """The adapters' part of a plan: sizes per stage in GB, sync bytes exact."""
    return {
        "rank": p.rank,
        "targets": list(p.targets),
        "sync": p.sync,
        "adapted_layers": p.adapted_layers,
        "params_m": round(p.params / 1e6, 2),
        "per_gpu_gb": [
            {"params": gb(a), "grads": gb(g), "optimizer": gb(o)}
            for a, g, o in zip(p.param_bytes, p.grad_bytes, p.optimizer_bytes, strict=True)
        ],
        "per_gpu_bytes": [
            {"params": a, "grads": g, "optimizer": o}
            for a, g, o in zip(p.param_bytes, p.grad_bytes, p.optimizer_bytes, strict=True)
        ],
        "sync_bytes": p.sync_bytes,
        "full_sync_bytes": p.full_sync_bytes,
        "sync_fraction": round(p.sync_fraction, 5),
    }


def gb(nbytes: int) -> float:
    """Bytes in GB, rounded to 10 MB."""
    return round(nbytes / GB, 2)


def _b(count: int) -> float:
    return round(count / 1e9, 3)


def stage_gb(stage: StageMemory) -> dict:
    """One stage's memory by kind, in GB."""
    return {
        "params": gb(stage.param_bytes),
        "grads": gb(stage.grad_bytes),
        "optimizer": gb(stage.optimizer_bytes),
        "activations": gb(stage.activation_bytes),
        "overhead": gb(stage.overhead_bytes),
        "total": gb(stage.total_bytes),
    }


def format_plan(p: Plan) -> str:
    """A readable table of a plan."""
    d = p.to_dict()
    tr, inf = d["trainer"], d["inference"]
    lines = [
        f"{p.name}: {p.family} ({p.model_source}), {d['params_b']['total']}B parameters"
        f" ({d['params_b']['active']}B active), {p.gpu} {d['gpu_memory_gb']} GB",
        f"trainer   {tr['gpus']} GPUs  {tr['layout']}  stage layers {tr['stage_layers']}"
        f"  {tr['microbatches']} microbatches of {tr['tokens_per_microbatch']} tokens",
        f"  {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'other':>8} {'total':>8}  (GB per GPU)",
    ]
    for s in p.trainer.stages:
        g = stage_gb(s)
        lines.append(
            f"  {s.stage:>5} {g['params']:>8} {g['grads']:>8} {g['optimizer']:>8} {g['activations']:>8}"
            f" {g['overhead']:>8} {g['total']:>8}"
        )
    pools = [("engines", inf)] + ([("teachers", d["teachers"])] if "teachers" in d else [])
    for name, pool in pools:
        gpus = pool["engines"] * pool["gpus_per_engine"]
        shape = f"  ({pool['shape_from']})" if "shape_from" in pool else ""
        lines += [
            f"{name:<9} {gpus} GPUs  {pool['engines']} x {pool['gpus_per_engine']} GPUs{shape}",
            _memory_line(pool),
        ]
    if p.lora is not None:
        lines += lora_lines(p.lora)
    return "\n".join(lines)


def _memory_line(pool: dict) -> str:
    e = pool["per_gpu_gb"]
    return (
        f"  weights {e['weights']} GB + overhead {e['overhead']} GB of a {e['budget']} GB budget -> KV cache"
        f" {e['kv_cache']} GB = {pool['kv_cache_tokens_per_replica']} tokens per replica"
        f" ({pool['kv_bytes_per_token']} B/token), {pool['max_sequences_per_replica']} full-length sequences"
    )


def lora_lines(p: LoraPlan) -> list[str]:
    """The adapters' lines of the table: per stage the adapter bytes on one GPU, then one sync's bytes."""
    layers = ", ".join(f"{t} {n}" for t, n in p.adapted_layers.items())
    lines = [
        f"lora      rank {p.rank}, sync {p.sync}: {p.params / 1e6:.1f}M adapter parameters ({layers})",
        f"  {'stage':>5} {'params':>10} {'grads':>10} {'optim':>10}  (MB per GPU, in the stage table above)",
    ]
    for stage, (a, g, o) in enumerate(zip(p.param_bytes, p.grad_bytes, p.optimizer_bytes, strict=True)):
        lines.append(f"  {stage:>5} {a / 1e6:>10.1f} {g / 1e6:>10.1f} {o / 1e6:>10.1f}")
    lines.append(
        f"  sync: {p.sync_bytes / GB:.3f} GB of adapters per update vs {p.full_sync_bytes / GB:.2f} GB for a full"
        f" sync ({100 * p.sync_fraction:.2f}%)"
    )
    return lines
