"""Routing replay (R3): make Megatron's MoE routers use given experts per token, or record the experts they chose.

Routes are `[batch, seq, num_moe_layers, top_k]` integer tensors of global expert ids (any integer dtype: the
engines send uint8 / int16), one column per MoE layer in global layer order (`moe_layer_numbers`), with an
optional `[batch, seq]` bool `free` mask (True: the token routes as the router itself chooses; padding, and the
last token of a sequence, which the engine never fed back into the model).

The hook is megatron-core's own: `TopKRouter.router_replay` (what `moe_enable_routing_replay` creates), which
`topk_routing_with_score_function` asks for the top-k of every token, with its actions RECORD / REPLAY_FORWARD /
REPLAY_BACKWARD (`transformer/moe/router_replay.py`, megatron-core 0.16.1). Each router of the model gets a
`RouterSlot` there, a subclass that adds what Megatron's class leaves to the caller:
- one target per micro-batch, consumed in schedule order (Megatron's holds one tensor per layer), so that a whole
  forward(-backward) schedule replays from one call around it, at any pipeline schedule that runs each stage's
  micro-batches in order (1F1B, interleaved: each model chunk has its own routers);
- REPLAY_BACKWARD chosen by itself for activation recompute: a router called inside the autograd backward pass is
  being recomputed, and takes the targets its forward used, in the same order;
- tokens that route freely (`free`), and the router's own choices recorded while it replays (router agreement);
- slots kept per model rather than in Megatron's process-wide instance list (a reference or teacher model in the
  same process routes freely).

On replay the gate weights are the trainer's own: Megatron gathers its router's scores at the replayed experts
(softmax over the replayed top-k logits for Qwen3-MoE / Mixtral, the unbiased sigmoid scores renormalised for
DeepSeek-V3), so the router still gets gradients; the engine's weights are not needed. The load-balancing loss is
computed from the router's own top-k as before.

Each pipeline stage holds and replays only its own layers' columns; under sequence parallelism each TP rank's
routers see its contiguous chunk of the sequence (tokens ordered sequence-major, as Megatron flattens
`[seq, batch]`), and recorded routes are all-gathered back over the TP group. Router fusion (`moe_router_fusion`)
bypasses the hook, so it is refused; so are sinkhorn routing and context parallelism.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_rl.errors import UserError
from megatron_rl.trainer.micro_batches import as_scheduled, schedule_shape


class RoutingReplayError(UserError, ValueError):
    """Routing replay cannot run as asked (a router setting it cannot honour, routes of the wrong shape)."""


def moe_layer_numbers(config) -> list[int]:
    """Megatron's global (1-based) layer numbers of the MoE layers, in order: route column i is layer
    `moe_layer_numbers(config)[i]` (`config.moe_layer_freq`, read as `get_gpt_decoder_block_spec` reads it)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    else:
        pattern = list(freq)
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]


def in_backward_pass() -> bool:
    """Whether autograd's backward pass is running on this thread (activation recompute runs the forward there)."""
    return torch._C._current_graph_task_id() != -1


class RouterSlot(RouterReplay):
    """One router's replay state: per-micro-batch targets for the forward, the ones used for recompute, records."""

    def __init__(self, column: int):
        # Megatron's __init__ also registers the instance in its process-wide list (every model's routers);
        # slots belong to one model here, so that list is not used.
        self.column = column
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list = []
        self.pending: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque()
        self.backward: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque()
        self.recorded: list[torch.Tensor] = []
        self.record_own = False

    def clear(self) -> None:
        """Forget targets and records; route freely."""
        self.pending.clear()
        self.backward.clear()
        self.recorded = []
        self.record_own = False
        self.router_replay_action = None

    def _next_target(self, backward: bool, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        queue = self.backward if backward else self.pending
        if not queue:
            where = "recompute in the backward pass" if backward else "forward"
            raise RoutingReplayError(
                f"routing replay: MoE layer column {self.column} was called for a {where} with no routes left "
                "(more micro-batches ran than were given routes)"
            )
        target, free = queue.popleft()
        if target.shape[0] != rows:
            raise RoutingReplayError(
                f"routing replay: MoE layer column {self.column} got {rows} tokens but its routes have "
                f"{target.shape[0]} (micro-batch size or sequence length differs from the routes')"
            )
        if not backward:
            self.backward.append((target, free))
        return target, free

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Megatron's hook: (scores at the chosen experts, their indices) for every token of `scores`."""
        action = self.router_replay_action
        if action is None:
            return default_compute_topk(scores, topk, num_groups, group_topk)
        backward = action is RouterReplayAction.REPLAY_BACKWARD or in_backward_pass()
        if action is RouterReplayAction.RECORD:
            values, indices = default_compute_topk(scores, topk, num_groups, group_topk)
            if not backward:
                self.recorded.append(indices.detach())
            return values, indices
        target, free = self._next_target(backward, scores.shape[0])
        target = target.to(scores.device)
        if free is not None or (self.record_own and not backward):
            _, own = default_compute_topk(scores, topk, num_groups, group_topk)
            if self.record_own and not backward:
                self.recorded.append(own.detach())
            if free is not None:
                target = torch.where(free.to(scores.device).unsqueeze(1), own, target)
        return scores.gather(1, target), target


def _routers(model) -> list[TopKRouter]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def _check_config(config) -> None:
    """Refuse router settings under which the hook is not called, or tokens are not where the slots expect."""
    if config.moe_router_fusion:
        raise RoutingReplayError(
            "routing replay needs the unfused router: moe_router_fusion=True computes the top-k in Transformer "
            "Engine's fused kernel, which bypasses Megatron's router_replay hook (set moe_router_fusion=False)"
        )
    if config.moe_router_load_balancing_type == "sinkhorn":
        raise RoutingReplayError("routing replay: sinkhorn routing does not use the top-k hook it replays through")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise RoutingReplayError("routing replay: context parallelism (load-balanced sequence chunks) is not supported")


class RoutingReplay:
    """The replay slots of one model (a GPTModel, or the list of its virtual-pipeline chunks) on this rank."""

    def __init__(self, model):
        routers = _routers(model)
        if not routers:
            raise RoutingReplayError("routing replay: the model has no MoE router on this rank")
        self.config = routers[0].config
        _check_config(self.config)
        numbers = moe_layer_numbers(self.config)
        self.num_moe_layers = len(numbers)
        self.top_k = self.config.moe_router_topk
        self.num_experts = self.config.num_moe_experts
        self.routers = routers
        self.slots: list[RouterSlot] = []
        for router in routers:
            if router.layer_number not in numbers:
                raise RoutingReplayError(
                    f"routing replay: router of layer {router.layer_number} is not among the MoE layers {numbers}"
                )
            if router.router_replay in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
            slot = RouterSlot(numbers.index(router.layer_number))
            router.router_replay = slot
            self.slots.append(slot)
        self.columns = sorted(slot.column for slot in self.slots)

    @property
    def _tp(self) -> tuple[int, int]:
        """(TP size, TP rank) as the routers' tokens are split: sequence chunks only under sequence parallel."""
        if not self.config.sequence_parallel:
            return 1, 0
        return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()

    def _local_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`[mb, S, ...]` -> this rank's router rows `[S_local * mb, ...]` (sequence-major, its SP chunk)."""
        tp, tp_rank = self._tp
        x = x.transpose(0, 1)
        if tp > 1:
            if x.shape[0] % tp:
                raise RoutingReplayError(f"routing replay: sequence length {x.shape[0]} is not divisible by TP {tp}")
            chunk = x.shape[0] // tp
            x = x[tp_rank * chunk : (tp_rank + 1) * chunk]
        return x.reshape(-1, *x.shape[2:])

    def _check_routes(self, routes: torch.Tensor, free: torch.Tensor | None) -> None:
        want = (self.num_moe_layers, self.top_k)
        if routes.dim() != 4 or tuple(routes.shape[2:]) != want:
            raise RoutingReplayError(
                f"routing replay: routes must be [batch, seq, {want[0]} MoE layers, top-{want[1]}], got "
                f"{list(routes.shape)}"
            )
        if routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise RoutingReplayError(f"routing replay: routes must be integer expert ids, got {routes.dtype}")
        checked = routes if free is None else routes[~free.bool()]
        if checked.numel() and (int(checked.min()) < 0 or int(checked.max()) >= self.num_experts):
            raise RoutingReplayError(
                f"routing replay: expert ids must lie in [0, {self.num_experts}), got "
                f"[{int(checked.min())}, {int(checked.max())}]"
            )
        if free is not None and tuple(free.shape) != tuple(routes.shape[:2]):
            raise RoutingReplayError(f"routing replay: free mask {list(free.shape)} != routes {list(routes.shape[:2])}")

    def _set(self, action: RouterReplayAction | None, record_own: bool = False) -> None:
        for slot in self.slots:
            slot.router_replay_action = action
            slot.record_own = record_own

    @contextlib.contextmanager
    def replaying(
        self, routes: torch.Tensor, free: torch.Tensor | None = None, micro_batch_size: int = 1, record: bool = False
    ) -> Iterator[RoutingReplay]:
        """Within the block, every forward of the model (and its recompute in backward) uses `routes`, split into
        micro-batches of `micro_batch_size` rows consumed in order; `free` tokens route freely. With `record`, the
        routers' own choices are recorded too (`recorded_routes`). Every rank passes the whole `[batch, seq, L, k]`
        routes (each takes its layers and sequence chunk). A forward with more micro-batches than given raises."""
        self._check_routes(routes, free)
        self.clear()
        for start in range(0, routes.shape[0], micro_batch_size):
            mb = routes[start : start + micro_batch_size]
            rows = self._local_rows(mb.long())
            mb_free = None
            if free is not None and bool(free[start : start + micro_batch_size].any()):
                mb_free = self._local_rows(free[start : start + micro_batch_size].bool())
            for slot in self.slots:
                slot.pending.append((rows[:, slot.column].contiguous(), mb_free))
        self._set(RouterReplayAction.REPLAY_FORWARD, record_own=record)
        try:
            yield self
        finally:
            for slot in self.slots:
                slot.pending.clear()
                slot.backward.clear()
            self._set(None)

    @contextlib.contextmanager
    def recording(self) -> Iterator[RoutingReplay]:
        """Within the block the routers route freely and record their choices (`recorded_routes`)."""
        self.clear()
        self._set(RouterReplayAction.RECORD)
        try:
            yield self
        finally:
            self._set(None)

    @contextlib.contextmanager
    def dispatched(self, micro_batch_size: int) -> Iterator[dict]:
        """The experts this rank's routers dispatched to within the block, whatever chose them (their routing maps:
        replayed, free or own), as `[B, S, L_stage, k]` (ascending expert ids) in `out["routes"]` once the block
        ends (every TP rank must be in it: sequence parallel gathers). Recomputes in the backward pass are not
        counted."""
        calls: dict[int, list[torch.Tensor]] = {}

        def hook(module, args, output):
            if not in_backward_pass():
                routing_map = output[1]
                rows = routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1)
                calls.setdefault(module.router_replay.column, []).append(rows)

        handles = [router.register_forward_hook(hook) for router in self.routers]
        out: dict = {}
        try:
            yield out
        finally:
            for handle in handles:
                handle.remove()
        if any(column not in calls for column in self.columns):
            raise RoutingReplayError("routing replay: no forward of the model's routers ran in the dispatched block")
        per_column = [torch.cat([self.whole_sequences(r, micro_batch_size) for r in calls[c]]) for c in self.columns]
        out["routes"] = torch.stack(per_column, dim=2)

    def clear(self) -> None:
        """Drop targets and records of every slot."""
        for slot in self.slots:
            slot.clear()

    def recorded_routes(self, micro_batch_size: int, all_layers: bool = False) -> torch.Tensor:
        """The recorded choices `[batch, seq, L, k]` (int64) of the forwards since `recording` / `replaying(...,
        record=True)` began, whole sequences on every TP rank; L is this stage's layers (`self.columns`), or with
        `all_layers` every MoE layer (all-gathered over the pipeline stages: every stage must call it)."""
        per_column = {}
        for slot in self.slots:
            if not slot.recorded:
                raise RoutingReplayError(f"routing replay: nothing recorded for MoE layer column {slot.column}")
            per_column[slot.column] = torch.cat(
                [self.whole_sequences(r, micro_batch_size) for r in slot.recorded], dim=0
            )
        local = torch.stack([per_column[c] for c in self.columns], dim=2)
        if not all_layers or parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return local
        return self._gather_stages(local)

    def whole_sequences(self, rows: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
        """One micro-batch's router rows `[S_local * mb, k]` (as a router of this rank sees its tokens) ->
        `[mb, S, k]`, all-gathered over the TP group under sequence parallelism (every TP rank must call it)."""
        tp, _ = self._tp
        seq_local = rows.shape[0] // micro_batch_size
        x = rows.reshape(seq_local, micro_batch_size, -1)
        if tp > 1:
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            x = torch.cat(parts, dim=0)
        return x.transpose(0, 1)

    def _gather_stages(self, local: torch.Tensor) -> torch.Tensor:
        """Every stage's columns `[B, S, L_stage, k]` -> all MoE layers `[B, S, L, k]` (in column order)."""
        group = parallel_state.get_pipeline_model_parallel_group()
        size = dist.get_world_size(group)
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
        dist.all_gather(counts, torch.tensor([len(self.columns)]), group=group)
        widest = max(int(c) for c in counts)
        padded = torch.zeros(*local.shape[:2], widest, local.shape[3], dtype=local.dtype)
        padded[:, :, : local.shape[2]] = local
        columns = torch.full((widest,), -1, dtype=torch.long)
        columns[: len(self.columns)] = torch.tensor(self.columns)
        parts = [torch.empty_like(padded) for _ in range(size)]
        all_columns = [torch.empty_like(columns) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        dist.all_gather(all_columns, columns, group=group)
        out = torch.empty(*local.shape[:2], self.num_moe_layers, local.shape[3], dtype=local.dtype)
        for part, cols in zip(parts, all_columns):
            for i, column in enumerate(cols.tolist()):
                if column >= 0:
                    out[:, :, column] = part[:, :, i]
        return out

    def agreement(
        self, recorded: torch.Tensor, routes: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[int, int]:
        """(equal, total) (token, MoE layer) pairs whose top-k sets agree between `recorded` (this stage's
        columns, as `recorded_routes` gives them) and the whole-model `routes` `[B, S, L, k]`, over `valid`
        `[B, S]` tokens, summed over the pipeline stages (the same on every rank of a model replica)."""
        equal, total = route_agreement(recorded, routes[:, :, self.columns], valid)
        counts = torch.tensor([equal, total], dtype=torch.long)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        return int(counts[0]), int(counts[1])


def route_agreement(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[int, int]:
    """(equal, total) over the (token, layer) pairs of two `[B, S, L, k]` route tensors whose top-k sets (order
    ignored) are equal, counting only `valid` `[B, S]` tokens when given."""
    if a.shape != b.shape:
        raise ValueError(f"route shapes differ: {list(a.shape)} and {list(b.shape)}")
    same = (a.long().sort(dim=-1).values == b.long().sort(dim=-1).values).all(dim=-1)
    if valid is not None:
        same = same[valid.bool()]
    return int(same.sum()), int(same.numel())


class BatchRouting:
    """How a batch's forwards of the policy route (`algorithm.routing`: `measure` or `replay`), and the router
    agreement between the engines' experts (`TrainBatch.routes`) and the trainer's own choices they measured."""

    def __init__(self, model, mode: str):
        self.replay = RoutingReplay(model)
        self.model = model
        self.mode = mode
        self.equal = self.total = 0

    @contextlib.contextmanager
    def forward(self, batch, plan, measure: bool) -> Iterator[None]:
        """Around one forward(-backward) schedule over `batch` (a `TrainBatch`) in the micro-batches of `plan`
        (`trainer/packing.MicroBatchPlan`): the engines' routes replayed (mode `replay`), and with `measure` the
        routers' own choices compared with them (every rank). Packed micro-batches get the routes packed alike."""
        if batch.routes is None:
            raise RoutingReplayError(
                f"algorithm.routing={self.mode} but the batch carries no routes (engines started without capture?)"
            )
        routes, free = (as_scheduled(t, plan, self.model) for t in plan.routes(batch.routes, batch.route_free))
        rows = schedule_shape(plan, self.model)[1]
        if self.mode == "replay":
            block = self.replay.replaying(routes, free, rows, record=measure)
        else:
            block = self.replay.recording() if measure else contextlib.nullcontext()
        with block:
            yield
        if measure:
            recorded = self.replay.recorded_routes(rows)
            equal, total = self.replay.agreement(recorded, routes, ~free)
            self.equal, self.total = self.equal + equal, self.total + total

    def stats(self, dp_group) -> dict[str, float]:
        """`routing/agreement` over the whole batch (summed over data parallel), then the counts start again."""
        counts = torch.tensor([self.equal, self.total], dtype=torch.float64)
        dist.all_reduce(counts, group=dp_group)
        self.equal = self.total = 0
        return {"routing/agreement": float(counts[0] / counts[1]) if counts[1] else float("nan")}
