"""Routed experts without Transformer Engine, all local experts in one grouped matmul per linear.

Megatron's local layer spec (no Transformer Engine: always on CPU) runs the routed experts as `SequentialMLP`:
each local expert's fc1, activation and fc2 as modules and autograd functions of their own, then a
concatenation, so a step's expert work is many small matmuls and their Python. `GroupedLocalExperts` keeps that
module's tree (the same parameters under the same names, so checkpoints, name maps, weight sync and LoRA see no
difference) and computes every local expert at once with `torch._grouped_mm` over the stacked weights (the op
transformers' own MoE models use on CPU). The gradients reach each expert's parameters through the stack, and
Megatron's DDP hooks add them to `main_grad` as they do for SequentialMLP's linears.

Where the grouped path does not apply it runs SequentialMLP's own loop: one local expert, biases on the experts,
fp8/fp4, probabilities applied on the input, another activation path than the plain one, a hook on an expert
linear (LoRA's adapters are forward hooks), a device other than the CPU, or widths the op cannot take (rows
must be multiples of 16 bytes).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from torch import Tensor

_ALIGN_BYTES = 16
"""`torch._grouped_mm` needs every row stride a multiple of 16 bytes (checked on torch 2.13.0+cpu)."""


class GroupedLocalExperts(SequentialMLP):
    """SequentialMLP's experts computed with one grouped matmul per linear for all local experts (module
    docstring); SequentialMLP's loop where that does not apply."""

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor):
        """(output `[tokens, hidden]` in the input's expert order, None): as SequentialMLP's forward."""
        if not self._grouped_applies(permuted_local_hidden_states):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        tokens = permuted_local_hidden_states.contiguous()
        ends = torch.as_tensor(tokens_per_expert, device=tokens.device).cumsum(0).to(torch.int32)
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts]).transpose(1, 2)
        hidden = self._activation(torch._grouped_mm(tokens, fc1, offs=ends))
        hidden = (hidden * permuted_probs.unsqueeze(-1)).to(tokens.dtype)
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts]).transpose(1, 2)
        return torch._grouped_mm(hidden, fc2, offs=ends), None

    def _activation(self, hidden: Tensor) -> Tensor:
        """MLP's unfused activation (megatron-core 0.16.1 `MLP.forward`): GLU with its clamp and offset, or the
        plain activation."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(hidden)
        gate, linear = torch.chunk(hidden, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (linear + config.glu_linear_offset)

    def _grouped_applies(self, tokens: Tensor) -> bool:
        """Whether this forward can take the grouped path (module docstring)."""
        config = self.config
        if self.num_local_experts < 2 or tokens.device.type != "cpu" or not hasattr(torch, "_grouped_mm"):
            return False
        if config.fp8 or config.fp4 or config.add_bias_linear or config.moe_apply_probs_on_input:
            return False
        if config.bias_activation_fusion or config.use_te_activation_func:
            return False
        linears = [m for expert in self.local_experts for m in (expert.linear_fc1, expert.linear_fc2)]
        if any(m._forward_hooks or m._forward_pre_hooks or m.weight.dtype != tokens.dtype for m in linears):
            return False
        fc1, fc2 = self.local_experts[0].linear_fc1.weight, self.local_experts[0].linear_fc2.weight
        widths = (*fc1.shape, *fc2.shape)
        return all(width * tokens.element_size() % _ALIGN_BYTES == 0 for width in widths)


def use_grouped_local_experts(block_spec) -> int:
    """Give every MoE layer of a local (non-TE) decoder block spec `GroupedLocalExperts` in place of
    `SequentialMLP`; return how many layers changed. The specs are replaced, not edited (layers may share them)."""
    changed = 0
    for index, layer in enumerate(block_spec.layer_specs):
        mlp = getattr(layer.submodules, "mlp", None)
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if experts is None or experts.module is not SequentialMLP:
            continue
        mlp_submodules = dataclasses.replace(
            mlp.submodules, experts=dataclasses.replace(experts, module=GroupedLocalExperts)
        )
        layer_submodules = dataclasses.replace(
            layer.submodules, mlp=dataclasses.replace(mlp, submodules=mlp_submodules)
        )
        block_spec.layer_specs[index] = dataclasses.replace(layer, submodules=layer_submodules)
        changed += 1
    return changed
