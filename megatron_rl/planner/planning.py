"""Plan a run config: read the model's shape, check the layouts against the model and the cluster, and check
that trainer and engines fit in GPU memory."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.models import CheckpointError, ModelArch, family_for_hf_config, get_family
from megatron_rl.parallel.layout import LayoutError, ParallelLayout, check_layout_fits_model, layout_from_config
from megatron_rl.planner.common import PlanError
from megatron_rl.planner.engines import EnginePlan, EngineShape, plan_engines
from megatron_rl.planner.lora import plan_lora
from megatron_rl.planner.params import model_size
from megatron_rl.planner.report import Plan, gb, stage_gb
from megatron_rl.planner.trainer import TrainerPlan, plan_trainer

TINY_VOCAB = 512
"""Vocabulary of the tiny model `make-tiny` writes (tools/make_tiny.py TINY_VOCAB; a test keeps them equal)."""
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _layout(cfg: RunConfig) -> ParallelLayout:
    return layout_from_config(cfg.trainer.parallel)


def load_model_config(cfg: RunConfig) -> tuple[dict, str]:
    """The HF config.json dict to plan with and where it came from.

    `model.hf_config` first (a relative path is tried from the working directory, then from the repository
    root, so `configs/models/...` works from anywhere in a checkout), then `model.hf_path/config.json`, then
    with `model.make_tiny` the tiny model `make-tiny` creates for `model.family` when hf_path is missing.
    """
    if cfg.model.hf_config:
        path = Path(cfg.model.hf_config)
        candidates = [path] if path.is_absolute() else [path, _REPO_ROOT / path]
        for candidate in candidates:
            if candidate.is_file():
                return _read_json(candidate), str(cfg.model.hf_config)
        raise PlanError(f"model.hf_config={cfg.model.hf_config!r}: no such file")
    path = Path(cfg.model.hf_path) / "config.json"
    if cfg.model.hf_path and path.is_file():
        return _read_json(path), str(path)
    if cfg.model.make_tiny:
        return get_family(cfg.model.family).tiny_hf_config(TINY_VOCAB), f"tiny {cfg.model.family}"
    raise PlanError(
        f"model.hf_path={cfg.model.hf_path!r} has no config.json and model.hf_config is empty: set model.hf_config"
        " to the model's config.json (see configs/models/)"
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlanError(f"{path}: unreadable config.json ({err})") from None


def check_cluster(cfg: RunConfig, layout: ParallelLayout) -> tuple[int, int]:
    """Trainer and engine GPU counts; PlanError when they do not match the declared nodes."""
    c, r, d = cfg.cluster, cfg.rollout, cfg.distill
    engine_gpus = r.num_engines * r.engine_tp * r.engine_dp
    teacher_gpus = d.num_engines * d.engine_tp if d.enabled else 0
    teachers = f" + the teachers' {teacher_gpus}" if teacher_gpus else ""
    if (c.trainer_nodes is None) != (c.inference_nodes is None):
        raise PlanError(
            f"cluster.trainer_nodes={c.trainer_nodes}, cluster.inference_nodes={c.inference_nodes}: set both"
            " (a multi-node run) or neither (trainer and engines share one node)"
        )
    if c.trainer_nodes is None:
        if layout.world_size + engine_gpus + teacher_gpus > c.gpus_per_node:
            raise PlanError(
                f"cluster.trainer_nodes is empty (one shared node), but the trainer's {layout.world_size} GPUs plus"
                f" the engines' {engine_gpus}{teachers} exceed cluster.gpus_per_node={c.gpus_per_node}"
            )
        return layout.world_size, engine_gpus + teacher_gpus
    trainer_gpus = c.trainer_nodes * c.gpus_per_node
    if layout.world_size != trainer_gpus:
        raise PlanError(
            f"cluster.trainer_nodes={c.trainer_nodes} x gpus_per_node={c.gpus_per_node} = {trainer_gpus} GPUs, but"
            f" trainer.parallel gives tp*pp*dp = {layout.tp}*{layout.pp}*{layout.data_parallel} ="
            f" {layout.world_size} ({layout.describe()})"
        )
    inference_gpus = c.inference_nodes * c.gpus_per_node
    if engine_gpus + teacher_gpus != inference_gpus:
        raise PlanError(
            f"cluster.inference_nodes={c.inference_nodes} x gpus_per_node={c.gpus_per_node} = {inference_gpus} GPUs,"
            f" but rollout.num_engines*engine_tp*engine_dp = {r.num_engines}*{r.engine_tp}*{r.engine_dp} ="
            f" {engine_gpus}"
            + (
                f" plus distill.num_engines*engine_tp = {d.num_engines}*{d.engine_tp} = {teacher_gpus}"
                if teachers
                else ""
            )
        )
    return trainer_gpus, inference_gpus


def _check_fits(cfg: RunConfig, trainer: TrainerPlan, engines: EnginePlan) -> None:
    worst = trainer.worst
    if worst.total_bytes > trainer.gpu_memory_bytes:
        parts = ", ".join(f"{k} {v}" for k, v in stage_gb(worst).items())
        raise PlanError(
            f"trainer.parallel ({trainer.layout}), trainer.micro_batch_size={cfg.trainer.micro_batch_size},"
            f" trainer.recompute={cfg.trainer.recompute}: pipeline stage {worst.stage} needs"
            f" {gb(worst.total_bytes)} GB per GPU ({parts}), more than cluster.gpu_memory_gb ="
            f" {gb(trainer.gpu_memory_bytes)} ({cfg.cluster.gpu})"
        )
    if engines.max_sequences < 1:
        raise PlanError(
            f"rollout.engine_tp={cfg.rollout.engine_tp}, engine_dp={cfg.rollout.engine_dp}, engine_ep="
            f"{cfg.rollout.engine_ep}, gpu_memory_utilization={cfg.rollout.gpu_memory_utilization}: "
            + _kv_shortfall(cfg, engines)
        )


def _kv_shortfall(cfg: RunConfig, engines: EnginePlan) -> str:
    return (
        f"weights {gb(engines.weight_bytes)} GB + overhead {gb(engines.overhead_bytes)} GB per GPU leave"
        f" {gb(engines.kv_cache_bytes)} GB of the {gb(engines.budget_bytes)} GB budget for the KV cache, not"
        f" enough for one sequence of model.max_sequence_length={cfg.model.max_sequence_length}"
    )


def plan_teachers(cfg: RunConfig, student_arch) -> tuple[EnginePlan | None, str]:
    """The teacher engines' per-GPU memory (on-policy distillation) and where their shape came from; (None, "")
    without a teacher. A snapshot teacher has the policy's shape; a fixed one the shape in `distill.teacher_path`'s
    config.json, or the policy's while that folder holds none yet (a teacher an earlier run will export)."""
    d = cfg.distill
    if not d.enabled:
        return None, ""
    arch, source = student_arch, "the policy's shape"
    path = Path(d.teacher_path) / "config.json"
    if d.teacher == "hf" and not path.is_file():
        source = f"the policy's shape ({path} does not exist yet)"
    elif d.teacher == "hf":
        hf_config = _read_json(path)
        try:
            arch = family_for_hf_config(hf_config).arch_from_hf(hf_config, str(path))
        except (CheckpointError, ValueError) as err:
            raise PlanError(f"teacher ({path}): {err}") from None
        source = str(path)
    teachers = plan_engines(cfg, arch, EngineShape.teachers(cfg))
    if teachers.max_sequences < 1:
        raise PlanError(f"distill.engine_tp={d.engine_tp}: the teacher's " + _kv_shortfall(cfg, teachers))
    return teachers, source


def checked_model(cfg: RunConfig, hf_config: dict, source: str = "config.json") -> ModelArch:
    """The model's shape, once its family is one we train, is the `model.family` the config names (when it names
    one: the trainer and the engines go by config.json) and the trainer's layout divides it; PlanError naming
    what does not. `megatron-rl train` runs it before anything starts, as `plan` does."""
    try:
        family = family_for_hf_config(hf_config, source)
        arch = family.arch_from_hf(hf_config, source)
    except CheckpointError as err:  # it names the source
        raise PlanError(str(err)) from None
    if cfg.model.family and cfg.model.family != family.name:
        raise PlanError(
            f"model.family={cfg.model.family}, but {source} holds a {family.name} model (set model.family={family.name},"
            " or null to take it from config.json)"
        )
    try:
        check_layout_fits_model(_layout(cfg), arch)
    except LayoutError as err:
        raise PlanError(f"trainer.{err}") from None
    return arch


def plan(cfg: RunConfig, hf_config: dict | None = None, model_source: str = "") -> Plan:
    """Plan a run config (with the model's HF config dict, read per `load_model_config` when not given)."""
    if hf_config is None:
        hf_config, model_source = load_model_config(cfg)
    arch = checked_model(cfg, hf_config, model_source or "config.json")
    layout = _layout(cfg)
    trainer_gpus, inference_gpus = check_cluster(cfg, layout)
    trainer = plan_trainer(cfg, arch, hf_config, layout)
    engines = plan_engines(cfg, arch)
    _check_fits(cfg, trainer, engines)
    teachers, teacher_source = plan_teachers(cfg, arch)
    size = model_size(arch, hf_config)
    lora = plan_lora(cfg, arch, layout, _stage_ranges(trainer.stage_layers), size.total) if cfg.lora.enabled else None
    return Plan(
        name=cfg.name, family=arch.family, model_source=model_source, size=size, gpu=cfg.cluster.gpu,
        trainer_gpus=trainer_gpus, inference_gpus=inference_gpus, trainer=trainer, engines=engines, lora=lora,
        teachers=teachers, teacher_source=teacher_source,
    )  # fmt: skip


def _stage_ranges(counts: list[int]) -> list[range]:
    """The global layer indices of each pipeline stage."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]
