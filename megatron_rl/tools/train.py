"""`megatron-rl train CONFIG`: the launching side of a run.

It starts a local Ray, the rollout buffer actor and the vLLM engine pool, launches the Megatron trainer under
torchrun (whose rank 0 runs the loop in `megatron_rl/orchestrator.py`), and runs the generation driver here until
the trainer finishes. At the end it checks the buffer's accounting, and writes the reward curve and a summary.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from megatron_rl.config import RunConfig, dump_config
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.torchrun import log_failure, start_torchrun, stop_process_group

ORCHESTRATOR = "megatron_rl.orchestrator"
BUFFER_NAME = "rollout-buffer"


def layout_of(cfg: RunConfig) -> ParallelLayout:
    """The trainer layout of a run config."""
    p = cfg.trainer.parallel
    return ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, dp=p.dp)


def ensure_model(cfg: RunConfig) -> str:
    """The HF checkpoint folder; a missing one with a family set is made with `make-tiny` (the quickstart)."""
    path = Path(cfg.model.hf_path)
    if (path / "config.json").exists():
        return str(path)
    if not cfg.model.family:
        raise FileNotFoundError(
            f"model.hf_path={cfg.model.hf_path!r}: no config.json there (set model.family to make a tiny one)"
        )
    from megatron_rl.tools.make_tiny import make_tiny

    return str(make_tiny(cfg.model.family, path, seed=cfg.trainer.seed))


def engine_specs(cfg: RunConfig, hf_path: str) -> list:
    """One EngineSpec per configured engine."""
    from megatron_rl.rollout.engine import EngineSpec

    r = cfg.rollout
    return [
        EngineSpec(
            name=f"engine-{i}", model_path=hf_path, dtype=cfg.model.dtype, tensor_parallel=r.engine_tp,
            data_parallel=r.engine_dp, expert_parallel=r.engine_ep, max_model_len=cfg.model.max_sequence_length,
            gpu_memory_utilization=r.gpu_memory_utilization, cpu_kv_cache_gb=r.cpu_kv_cache_gb,
            seed=cfg.trainer.seed + i, max_num_seqs=max(16, r.max_concurrent_prompts * r.samples_per_prompt),
            cpu_affinity=list(r.cpu_affinity),
        )
        for i in range(r.num_engines)
    ]  # fmt: skip


async def _drive(driver, proc, poll_s: float = 0.5) -> None:
    """Run generation until the trainer process exits; a failed driver stops the trainer at once."""
    task = asyncio.create_task(driver.run())
    while proc.poll() is None and not task.done():
        await asyncio.sleep(poll_s)
    if task.done() and task.exception() is not None:
        stop_process_group(proc)
        raise RuntimeError(f"generation driver failed: {task.exception()!r}") from task.exception()
    driver.stop()
    await asyncio.wait_for(task, timeout=120)


def run_training(cfg: RunConfig) -> dict:
    """Run the whole job; returns the summary (also written to the run folder)."""
    import ray

    from megatron_rl.metrics import plot_reward_curve, read_metrics
    from megatron_rl.rollout.buffer import make_buffer_actor
    from megatron_rl.rollout.driver import GenerationDriver, mode_lag
    from megatron_rl.rollout.pool import EnginePool
    from megatron_rl.rollout.ray_utils import start_local_ray
    from megatron_rl.rollout.tasks import PromptStream, load_tokenizer, make_task

    run_dir = Path(cfg.output_dir) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    hf_path = ensure_model(cfg)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf_path": hf_path})})
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    tokenizer = load_tokenizer(hf_path)
    task = make_task(cfg.task, tokenizer, seed=cfg.task.seed, length=cfg.task.length)
    layout = layout_of(cfg)
    start = time.perf_counter()
    ray_info = start_local_ray()
    buffer = make_buffer_actor(
        capacity=cfg.buffer.capacity, max_staleness=cfg.buffer.max_staleness, stale_policy=cfg.buffer.stale_policy,
        prompts=PromptStream(task, cfg.task.epochs), max_requeues=cfg.buffer.max_requeues, name=BUFFER_NAME,
    )  # fmt: skip
    pool = EnginePool(engine_specs(cfg, hf_path), cpus_per_engine=0.5)
    proc = None
    try:
        pool.start()
        spec = {
            "config": cfg.model_dump(mode="json"), "ray_address": ray_info["address"], "buffer": BUFFER_NAME,
            "engines": [[h.name, h.workers] for h in pool.handles()], "run_dir": str(run_dir),
        }  # fmt: skip
        (run_dir / "trainer_spec.json").write_text(json.dumps(spec))
        log_path = run_dir / "trainer.log"
        proc = start_torchrun(ORCHESTRATOR, [str(run_dir / "trainer_spec.json")], layout.world_size, log_path)
        driver = GenerationDriver(
            buffer, dict(pool.actors), task, tokenizer, cfg, mode_lag(cfg.mode, cfg.buffer.max_staleness)
        )
        asyncio.run(_drive(driver, proc))
        if proc.wait() != 0:
            raise log_failure(log_path, ORCHESTRATOR, proc.returncode)
        accounting = ray.get(buffer.check_accounting.remote(), timeout=60)
        engines = pool.health()
    finally:
        if proc is not None:
            stop_process_group(proc)
        pool.shutdown()
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_reward_curve(run_dir / "metrics.jsonl", run_dir / "reward_curve.png", title=f"{cfg.name}: {cfg.mode}")
    summary = {
        "run_dir": str(run_dir), "mode": cfg.mode, "steps": len(records), "wall_seconds": round(time.perf_counter() - start, 1),
        "reward_first": records[0]["reward/mean"] if records else None,
        "reward_last": records[-1]["reward/mean"] if records else None,
        "reward_best": max((r["reward/mean"] for r in records), default=None),
        "accounting": accounting, "driver": vars(driver.stats), "engines": engines, "task": task.report(),
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
