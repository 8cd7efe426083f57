"""A selection-only perturbation of an engine's MoE routers, for `verify routing`: some top-k choices flip, the gate
weights of the chosen experts stay those of the true router logits.

This mimics a numerical routing mismatch between engine and trainer (the same weights, different experts chosen
near ties): only then can routing replay bring the trainer's logprobs to the engine's. Each MoE layer of the
worker's model gets a fixed per-expert vector `b` (seeded by the seed and the layer); a token with router logits
`z` selects the top-k of `z + scale * std(z) * b` (`std` over that token's experts, so the shift is relative to
its own logit spread and does not depend on what else is in the batch), and its weights are the router's own of
`z` at those experts: the softmax of the chosen logits when the router renormalises, else their share of the
softmax over all experts (as vLLM 0.32's CPU router, `fused_moe/router/cpu_router.py` `_softmax_topk`, computes
them).

It replaces `_compute_routing` on the router instance (`BaseRouter._select_experts` calls it, then the
routed-experts capture, so captured routes are the perturbed choices). Only plain softmax top-k routers are
perturbed (no grouped top-k, correction bias or custom routing function), and only modular MoE kernels (a
monolithic kernel routes inside itself); anything else raises `ValueError` naming the layer. Every routed token
is counted, and those whose top-k set the perturbation changed (`flips`).

vLLM is imported where it is used: the launcher imports the worker extension, which imports this module.
"""

from __future__ import annotations

import zlib

import torch


def biased_topk(
    logits: torch.Tensor, bias: torch.Tensor, scale: float, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights `[n, k]` float32, ids `[n, k]` int32, the unperturbed ids `[n, k]`) of router `logits` `[n, E]`:
    the top-k of `logits + scale * std(logits) * bias`, weighted as the router weights the true logits."""
    z = logits.float()
    shift = scale * z.std(dim=-1, keepdim=True, unbiased=False) * bias.to(z.device, z.dtype)
    ids = torch.topk(z + shift, k=top_k, dim=-1, sorted=False).indices
    own = torch.topk(z, k=top_k, dim=-1, sorted=False).indices
    chosen = z.gather(1, ids)
    if renormalize:
        weights = torch.softmax(chosen, dim=-1)
    else:
        weights = (chosen - torch.logsumexp(z, dim=-1, keepdim=True)).exp()
    return weights.contiguous(), ids.to(torch.int32).contiguous(), own


def flipped(ids: torch.Tensor, own: torch.Tensor) -> int:
    """How many rows' top-k sets differ between `ids` and `own` (order ignored)."""
    return int((ids.long().sort(-1).values != own.long().sort(-1).values).any(-1).sum())


def expert_bias(num_experts: int, seed: int, layer: int) -> torch.Tensor:
    """The fixed per-expert vector of one layer (standard normal, seeded by the seed and the layer)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"layer{layer}".encode()))
    return torch.randn(num_experts, generator=gen)


def _check_router(router, layer: int) -> None:
    """Refuse routers whose routing this perturbation does not reproduce (see the module doc)."""
    scoring = getattr(router, "scoring_func", "softmax")
    reasons = [
        what
        for what, bad in (
            ("grouped top-k", getattr(router, "use_grouped_topk", False)),
            (f"scoring {scoring!r}", scoring != "softmax"),
            ("an expert correction bias", getattr(router, "e_score_correction_bias", None) is not None),
            ("a custom routing function", getattr(router, "custom_routing_function", None) is not None),
            ("no renormalize setting", not hasattr(router, "renormalize")),
        )
        if bad
    ]
    if reasons:
        raise ValueError(
            f"router perturbation: MoE layer {layer} ({type(router).__name__}) has {', '.join(reasons)}; only plain "
            "softmax top-k routers are perturbed"
        )


class RouterBias:
    """The perturbation installed on every MoE router of one vLLM worker's model, with its flip counts."""

    def __init__(self, model: torch.nn.Module, scale: float, seed: int):
        # vLLM here, not at the top: the launcher imports this module (through the worker extension) without vLLM.
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.scale, self.seed = float(scale), int(seed)
        self.counts = {"tokens": 0, "flipped": 0}
        self.layers: list[int] = []
        for module in model.modules():
            if not isinstance(module, MoERunner):
                continue
            layer, router = module.layer_id, module.router
            if module._quant_method.is_monolithic:
                raise ValueError(f"router perturbation: MoE layer {layer} runs a monolithic kernel that routes itself")
            _check_router(router, layer)
            bias = expert_bias(router.global_num_experts, self.seed, layer)
            router._compute_routing = self._routing(router, bias)
            self.layers.append(layer)
        if not self.layers:
            raise ValueError("router perturbation: the model has no MoE router on this worker")

    def _routing(self, router, bias: torch.Tensor):
        """The replacement of one router's `_compute_routing` (same signature)."""

        def compute(hidden_states, router_logits, indices_type, *, input_ids=None):
            weights, ids, own = biased_topk(router_logits, bias, self.scale, router.top_k, router.renormalize)
            self.counts["tokens"] += ids.shape[0]
            self.counts["flipped"] += flipped(ids, own)
            return weights, ids

        return compute

    def take_counts(self, reset: bool = True) -> dict:
        """(token, layer) pairs routed since the last reset and how many of them the perturbation flipped."""
        counts = dict(self.counts)
        if reset:
            self.counts = {"tokens": 0, "flipped": 0}
        return counts

    def describe(self) -> dict:
        return {"scale": self.scale, "seed": self.seed, "layers": self.layers, **self.counts}
