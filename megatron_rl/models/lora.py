"""LoRA adapters' Megatron and Hugging Face / peft names, their shard rules, and their shapes, derived from a
family's parameter map. Pure: no torch at import, no process groups.

An adapter on the Megatron linear `X` (canonical weight `X.weight`) is the sibling module `X_lora` with
parameters `lora_A` [rank, in] and `lora_B` [out, rank]. Its HF names are the base's with `.weight` replaced by
`.lora_A.weight` / `.lora_B.weight` (peft's names without its `base_model.model.` prefix). A fused Megatron
layer shares one A over the HF modules it fuses (q/k/v, gate/up), so each of them gets the same A and its own
rows of B, split the way the base weight is (`transforms.py`): exactly what peft computes with those tensors.

Tensor parallel layout, as the base weight's (`ParamRule.tp_dim`): a column-parallel layer (`tp_dim` 0: linear_qkv,
linear_fc1) keeps A whole and splits B's output rows like the base (fused gate/up in two blocks); a row-parallel
layer (`tp_dim` 1: linear_proj, linear_fc2) splits A's input columns and keeps B whole. Routed experts have one
pair per expert, split over expert-tensor-parallel ranks the same way and held by the expert's EP rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from megatron_rl.models.base import ModelArch, ModelFamily, ParamRule

ADAPTER_SUFFIX = "_lora"
"""The adapter of Megatron module `X` is the module `X_lora` beside it."""
_LEAF_TARGETS = {"linear_qkv": "linear_qkv", "linear_proj": "linear_proj", "linear_fc1": "linear_fc1",
                 "linear_fc2": "linear_fc2"}  # fmt: skip
_EXPERT_TARGETS = {"linear_fc1": "expert_fc1", "linear_fc2": "expert_fc2"}


@dataclasses.dataclass(frozen=True)
class SharedRule(ParamRule):
    """A tensor every one of its HF names holds whole: the LoRA A of a fused layer (q/k/v, gate/up)."""

    def to_mcore(self, hf_tensors: list, arch: ModelArch):
        """The Megatron tensor: the first HF tensor (they are all the same)."""
        return hf_tensors[0]

    def to_hf(self, tensor, arch: ModelArch) -> list:
        """One copy per HF name."""
        return [tensor] * len(self.hf)


@dataclasses.dataclass(frozen=True)
class AdapterRules:
    """The A and B rules of the adapter on one base linear."""

    target: str
    """The `lora.targets` entry it belongs to."""
    base: ParamRule
    """The base weight's rule."""
    a: ParamRule
    """lora_A [rank, in]: whole on column-parallel layers, input columns split on row-parallel ones."""
    b: ParamRule
    """lora_B [out, rank]: output rows split like the base on column-parallel layers, whole on row-parallel ones."""

    @property
    def column_parallel(self) -> bool:
        """Whether the base layer splits its output (column-parallel) rather than its input."""
        return self.base.tp_dim == 0


def target_of(rule: ParamRule) -> str | None:
    """The LoRA target a base parameter rule is the weight of, or None (not an adaptable linear)."""
    if not rule.mcore.endswith(".weight"):
        return None
    leaf = rule.mcore[: -len(".weight")].rsplit(".", 1)[-1]
    if rule.is_expert:
        return _EXPERT_TARGETS.get(leaf)
    return _LEAF_TARGETS.get(leaf) if rule.tp_dim in (0, 1) else None


def adapter_module_name(base_module: str) -> str:
    """The adapter module's (local or canonical) name beside the base linear `base_module`."""
    return base_module + ADAPTER_SUFFIX


def _lora_hf(name: str, which: str) -> str:
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    return f"{stem}.lora_{which}.weight"


def adapter_rules(rule: ParamRule, target: str) -> AdapterRules:
    """The A and B rules of an adapter on the linear whose weight rule is `rule`."""
    module = adapter_module_name(rule.mcore[: -len(".weight")])
    common = dict(is_expert=rule.is_expert, layer=rule.layer, expert=rule.expert)
    hf_a = tuple(_lora_hf(n, "A") for n in rule.hf)
    hf_b = tuple(_lora_hf(n, "B") for n in rule.hf)
    if rule.tp_dim == 0:
        a = SharedRule(module + ".lora_A", hf_a, **common)
        b = ParamRule(module + ".lora_B", hf_b, rule.transform, tp_dim=0, tp_chunks=rule.tp_chunks, **common)
    else:
        a = SharedRule(module + ".lora_A", hf_a, tp_dim=1, **common)
        b = ParamRule(module + ".lora_B", hf_b, rule.transform, **common)
    return AdapterRules(target=target, base=rule, a=a, b=b)


def adapter_rule_table(family: ModelFamily, arch: ModelArch, targets: Iterable[str]) -> dict[str, AdapterRules]:
    """Canonical base weight name -> its adapter's rules, for every linear of the model that `targets` names."""
    wanted = set(targets)
    table = {}
    for rule in family.param_rules(arch):
        target = target_of(rule)
        if target in wanted:
            table[rule.mcore] = adapter_rules(rule, target)
    return table


def parameter_rules(table: dict[str, AdapterRules]) -> dict[str, ParamRule]:
    """Canonical adapter parameter name (`..._lora.lora_A` / `lora_B`) -> its rule."""
    out = {}
    for rules in table.values():
        out[rules.a.mcore] = rules.a
        out[rules.b.mcore] = rules.b
    return out


def hf_adapter_shapes(
    table: dict[str, AdapterRules], rank: int, base_shape: Callable[[str], tuple[int, ...]]
) -> dict[str, tuple[int, int]]:
    """HF adapter name -> shape (the parameter map's order, A before B), from the base HF weights' shapes (`base_shape(name)`,
    e.g. read from the checkpoint's headers): base [out, in] -> lora_A [rank, in], lora_B [out, rank]. What a sync
    plan or an export lays out before any tensor is gathered."""
    shapes = {}
    for rules in table.values():
        base = [tuple(base_shape(name)) for name in rules.base.hf]
        for name, (_, fan_in) in zip(rules.a.hf, base, strict=True):
            shapes[name] = (rank, fan_in)
        for name, (fan_out, _) in zip(rules.b.hf, base, strict=True):
            shapes[name] = (fan_out, rank)
    return shapes


@dataclasses.dataclass(frozen=True)
class AdaptedLinear:
    """The adapters of one target in one layer (all of a layer's experts together), for counting."""

    target: str
    """`lora.targets` entry."""
    layer: int
    """Global layer index."""
    in_features: int
    """Input width of the base linear (full, unsharded)."""
    out_features: int
    """Output width of the base linear (full, unsharded; q|k|v or gate|up fused)."""
    column_parallel: bool
    """Whether B is split (column-parallel) rather than A (row-parallel)."""
    hf_modules: int
    """HF modules the fused linear covers (3 for q/k/v, 2 for gate/up, else 1): each holds its own copy of A."""
    copies: int = 1
    """How many such linears (the routed experts of the layer; 1 otherwise)."""

    def params(self, rank: int) -> int:
        """Trainer parameters: A [rank, in] + B [out, rank], times `copies`."""
        return self.copies * rank * (self.in_features + self.out_features)

    def hf_params(self, rank: int) -> int:
        """Elements of the HF / peft tensors (A once per HF module): what an adapter sync or export holds."""
        return self.copies * rank * (self.hf_modules * self.in_features + self.out_features)


def _attention_linears(arch: ModelArch, family: ModelFamily, layer: int, targets: set[str]) -> list[AdaptedLinear]:
    h = arch.hidden_size
    out = []
    if "linear_qkv" in targets and not family.uses_mla():
        qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        out.append(AdaptedLinear("linear_qkv", layer, h, qkv, True, 3))
    if "linear_proj" in targets:
        v_dim = arch.get("v_head_dim") if family.uses_mla() else arch.head_dim
        out.append(AdaptedLinear("linear_proj", layer, arch.num_heads * v_dim, h, False, 1))
    return out


def _mlp_linears(arch: ModelArch, layer: int, targets: set[str]) -> list[AdaptedLinear]:
    h, out = arch.hidden_size, []
    dense = arch.shared_expert_ffn_hidden_size if arch.is_moe_layer(layer) else arch.ffn_hidden_size
    if dense and "linear_fc1" in targets:
        out.append(AdaptedLinear("linear_fc1", layer, h, 2 * dense, True, 2))
    if dense and "linear_fc2" in targets:
        out.append(AdaptedLinear("linear_fc2", layer, dense, h, False, 1))
    if arch.is_moe_layer(layer):
        f, e = arch.moe_ffn_hidden_size, arch.num_experts
        if "expert_fc1" in targets:
            out.append(AdaptedLinear("expert_fc1", layer, h, 2 * f, True, 2, copies=e))
        if "expert_fc2" in targets:
            out.append(AdaptedLinear("expert_fc2", layer, f, h, False, 1, copies=e))
    return out


def adapted_linears(family: ModelFamily, arch: ModelArch, targets: Iterable[str], layers: Iterable[int] | None = None):
    """Every adapted linear of `layers` (default: all), from the model's shape alone (the planner's count).

    A target the model lacks is skipped: expert targets on a dense model, `linear_qkv` on MLA attention (its
    q/kv projections are separate low-rank linears that take no adapter here)."""
    wanted = set(targets)
    out = []
    for layer in range(arch.num_layers) if layers is None else layers:
        out += _attention_linears(arch, family, layer, wanted) + _mlp_linears(arch, layer, wanted)
    return out
