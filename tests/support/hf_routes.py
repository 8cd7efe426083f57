"""Reference routes and logprobs from transformers' own Qwen3-MoE: the experts its routers choose per token, and
its logprobs with given experts forced on its routers (gate weights from its own router logits, as Megatron's
replay computes them). Also a copy of a checkpoint with its router weights perturbed, so some choices flip."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _gates(model) -> list:
    """The MoE routers (`mlp.gate` with a `top_k`) of the decoder layers, in layer order."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(getattr(layer.mlp, "gate", None), "top_k")]


def _load(hf_dir: str | Path):
    from transformers import AutoModelForCausalLM  # seconds to import; only the tests that compare use it

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def _forcing_hook(gate, routes: torch.Tensor, free: torch.Tensor | None):
    """A forward hook replacing the gate's experts by `routes` `[B, S, k]` (own choice where `free`) and its
    weights by its own softmax at those experts (renormalised as the gate does)."""

    def hook(module, args, output):
        logits, _, own = output
        forced = routes.reshape(-1, routes.shape[-1]).long()
        if free is not None:
            forced = torch.where(free.reshape(-1, 1), own, forced)
        weights = torch.softmax(logits.float(), dim=-1).gather(1, forced)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), forced

    return hook


def hf_routes_and_logprobs(
    hf_dir: str | Path, tokens: torch.Tensor, forced: torch.Tensor | None = None, free: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes `[B, S, L, k]` the experts each MoE layer used, logprobs `[B, S-1]` of tokens[:, 1:]); with `forced`
    `[B, S, L, k]` those experts are used instead (their own choice where `free` `[B, S]`)."""
    model = _load(hf_dir)
    used: list[torch.Tensor] = []
    handles = []
    for column, gate in enumerate(_gates(model)):
        if forced is not None:
            handles.append(gate.register_forward_hook(_forcing_hook(gate, forced[:, :, column], free)))
        handles.append(gate.register_forward_hook(lambda m, a, out: used.append(out[2].detach().clone())))
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float()
    finally:
        for handle in handles:
            handle.remove()
    routes = torch.stack([u.reshape(*tokens.shape, -1) for u in used], dim=2)
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return routes, logprobs


def perturbed_router_copy(hf_dir: str | Path, out: str | Path, scale: float, seed: int = 0) -> Path:
    """A copy of the checkpoint with every router weight plus Gaussian noise of `scale` times its own std."""
    return perturbed_copy(hf_dir, out, scale, seed, suffix="mlp.gate.weight")


def perturbed_copy(hf_dir: str | Path, out: str | Path, scale: float, seed: int = 0, suffix: str = "") -> Path:
    """A copy of the checkpoint with every weight whose name ends with `suffix` (all: "") plus Gaussian noise of
    `scale` times its own std (a policy that moved, or routers that choose differently)."""
    src, out = Path(hf_dir), Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name, tensor in tensors.items():
            if name.endswith(suffix) and tensor.is_floating_point() and tensor.numel() > 1:
                noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
                tensors[name] = (tensor.float() + scale * float(tensor.float().std()) * noise).to(tensor.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return out
