"""What a model family is: how its Hugging Face config maps to Megatron, and how its parameters map by name.

Pure data and functions: no process groups, no Megatron import. The trainer turns `megatron_config_kwargs`
into a `TransformerConfig`; the weight path uses the `ParamRule` table to move tensors between layouts.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any

from megatron_rl.errors import UserError
from megatron_rl.models import transforms


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, malformed or does not fit the model it is loaded into."""


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """The shape facts of one model, read from its Hugging Face `config.json`."""

    family: str
    """Name of the model family (`qwen3_moe`, `mixtral`, `deepseek_v3`, `qwen3`)."""
    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Width of the residual stream."""
    num_heads: int
    """Number of attention (query) heads."""
    num_kv_heads: int
    """Number of key/value heads (query groups)."""
    head_dim: int
    """Width of one attention head."""
    vocab_size: int
    """Size of the (unpadded) vocabulary."""
    ffn_hidden_size: int
    """Intermediate size of a dense MLP."""
    num_experts: int = 0
    """Number of routed experts; 0 for a dense model."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one routed expert."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the layers whose MLP is a mixture of experts."""
    shared_expert_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert(s), 0 when there is none."""
    tie_word_embeddings: bool = False
    """Whether the output layer reuses the input embedding."""
    qkv_bias: bool = False
    """Whether q/k/v projections carry biases."""
    extra: tuple[tuple[str, Any], ...] = ()
    """Family-specific facts (for example MLA ranks), as sorted key/value pairs."""

    def get(self, key: str, default: Any = None) -> Any:
        """Return a family-specific fact stored in `extra`."""
        return dict(self.extra).get(key, default)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based, global) has a routed-expert MLP."""
        return layer in self.moe_layers


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """How one Megatron parameter (canonical name, global indices) maps to Hugging Face tensors.

    `transform` names a function pair in `transforms.TRANSFORMS`: it turns the HF tensors into the full
    (unsharded) Megatron tensor and back. `tp_dim` is the dimension split across tensor parallel ranks (expert
    tensor parallel for expert weights), None when replicated; `tp_chunks` > 1 says the full tensor is that many
    equal blocks along `tp_dim` and each block is split separately (gate/up fusion).
    """

    mcore: str
    hf: tuple[str, ...]
    transform: str = "copy"
    tp_dim: int | None = None
    tp_chunks: int = 1
    is_expert: bool = False
    layer: int | None = None
    expert: int | None = None

    def to_mcore(self, hf_tensors: list, arch: ModelArch):
        """Build the full Megatron tensor from the HF tensors named in `hf` (in that order)."""
        return transforms.TRANSFORMS[self.transform][0](hf_tensors, arch)

    def to_hf(self, tensor, arch: ModelArch) -> list:
        """Split a full Megatron tensor into the HF tensors named in `hf` (in that order)."""
        return transforms.TRANSFORMS[self.transform][1](tensor, arch)


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """One layer's attention parameters with its input norm, split by how tensor parallelism shards them."""

    tp: int
    """Split across tensor-parallel ranks (the projections split by heads, their biases)."""
    replicated: int
    """Whole on every tensor-parallel rank (norms, MLA's down projections)."""


class ModelFamily(ABC):
    """One model family: recognition, config translation and the parameter map."""

    name: str = ""
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    qk_norm: bool = False
    """Whether grouped-query attention normalises each head's queries and keys (HF `q_norm` / `k_norm`)."""

    def arch_from_hf(self, hf_config: dict, source: str = "config.json") -> ModelArch:
        """Read the model's shape from a Hugging Face `config.json` dictionary and check that it is sane.

        Every problem ends as one CheckpointError that names `source` (the file), the key and its value.
        """
        if not isinstance(hf_config, dict):
            raise CheckpointError(f"{source}: must hold a JSON object, got {type(hf_config).__name__}")
        try:
            arch = self._read_arch(hf_config)
        except CheckpointError as err:
            raise CheckpointError(f"{source}: {err}") from None
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as err:
            raise CheckpointError(f"{source}: not a valid {self.name} config ({type(err).__name__}: {err})") from None
        problems = arch_problems(arch, hf_config)
        if problems:
            raise CheckpointError(f"{source}: " + "; ".join(problems))
        return arch

    @abstractmethod
    def _read_arch(self, hf_config: dict) -> ModelArch:
        """Read the model's shape from a Hugging Face `config.json` dictionary (checked by `arch_from_hf`)."""

    @abstractmethod
    def megatron_config_kwargs(self, arch: ModelArch, hf_config: dict) -> dict:
        """Keyword arguments for Megatron's TransformerConfig (strings stand in for callables)."""

    @abstractmethod
    def param_rules(self, arch: ModelArch) -> list[ParamRule]:
        """Every Megatron parameter of the whole model with its HF names and transform."""

    @abstractmethod
    def tiny_hf_config(self, vocab_size: int) -> dict:
        """A small `config.json` of this family for tests and demos."""

    def uses_mla(self) -> bool:
        """Whether attention is multi-latent (MLATransformerConfig)."""
        return False

    def attention_params(self, arch: ModelArch) -> AttentionParams:
        """One layer's attention with its input norm; grouped-query attention unless overridden.

        q, k, v and o projections (and q/k/v biases) are split by heads; the input norm and the per-head q/k
        norms (`qk_norm`) are whole on every rank.
        """
        h = arch.hidden_size
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        weights = h * (q + 2 * kv) + q * h
        bias = (q + 2 * kv) if arch.qkv_bias else 0
        norms = h + (2 * arch.head_dim if self.qk_norm else 0)
        return AttentionParams(tp=weights + bias, replicated=norms)

    def attention_activation_elements(self, arch: ModelArch) -> int:
        """Elements per token one layer's attention keeps for its backward pass, before tensor parallelism.

        Korthikanti et al. 2022's bookkeeping with flash attention (no scores stored) and no dropout; grouped-query
        attention: norm input h, QKV input h, q/k/v outputs q + 2kv, core-attention output q -> 2h + 2q + 2kv.
        """
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return 2 * arch.hidden_size + 2 * q + 2 * kv

    def kv_cache_elements(self, arch: ModelArch, engine_tp: int) -> int:
        """KV-cache values one token takes in one layer on one engine GPU at tensor parallel `engine_tp`.

        Grouped-query attention: a key and a value per local key/value head; vLLM replicates the heads when
        engine_tp exceeds them, so a GPU holds at least one.
        """
        return 2 * max(1, arch.num_kv_heads // engine_tp) * arch.head_dim

    def kv_heads_fit(self, arch: ModelArch, engine_tp: int) -> bool:
        """Whether vLLM can place the key/value heads on `engine_tp` ranks: one count must divide the other."""
        kv = arch.num_kv_heads
        return kv % engine_tp == 0 or engine_tp % kv == 0

    def te_variant(self, rule: ParamRule) -> ParamRule:
        """The rule as the Transformer Engine layer spec shards it (same as the local spec unless overridden)."""
        return rule

    def rule_table(self, arch: ModelArch, te_spec: bool = False) -> dict[str, ParamRule]:
        """The parameter rules keyed by canonical Megatron name; checks that no HF name is used twice."""
        table: dict[str, ParamRule] = {}
        seen_hf: dict[str, str] = {}
        for rule in self.param_rules(arch):
            if te_spec:
                rule = self.te_variant(rule)
            if rule.mcore in table:
                raise AssertionError(f"{self.name}: Megatron name {rule.mcore} mapped twice")
            for hf_name in rule.hf:
                if hf_name in seen_hf:
                    raise AssertionError(f"{self.name}: HF name {hf_name} used by {seen_hf[hf_name]} and {rule.mcore}")
                seen_hf[hf_name] = rule.mcore
            table[rule.mcore] = rule
        return table


def rope_theta(hf_config: dict, default: float = 10000.0) -> float:
    """Rotary base from either the transformers 4 (`rope_theta`) or 5 (`rope_parameters`) spelling."""
    params = hf_config.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf_config.get("rope_theta", default))


_HF_KEYS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}
"""ModelArch fields that must be positive, with the config.json key each comes from."""


def arch_problems(arch: ModelArch, hf_config: dict) -> list[str]:
    """What makes a model shape unusable (empty when it is fine), each naming the config.json key and value."""
    problems = [
        f"{key}={getattr(arch, field)} must be at least 1"
        for field, key in _HF_KEYS.items()
        if getattr(arch, field) < 1
    ]
    if arch.num_heads >= 1 and arch.num_kv_heads >= 1 and arch.num_heads % arch.num_kv_heads:
        problems.append(
            f"num_attention_heads={arch.num_heads} is not a multiple of num_key_value_heads={arch.num_kv_heads}"
        )
    if arch.num_experts < 0:
        problems.append(f"number of experts {arch.num_experts} must not be negative")
    if arch.moe_layers and arch.moe_ffn_hidden_size < 1:
        problems.append(f"moe_intermediate_size={arch.moe_ffn_hidden_size} must be at least 1")
    top_k = hf_config.get("num_experts_per_tok")
    if arch.num_experts > 0 and top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= arch.num_experts):
        problems.append(
            f"num_experts_per_tok={top_k!r} must be between 1 and the number of experts ({arch.num_experts})"
        )
    return problems


def require(hf_config: dict, key: str | tuple[str, ...], where: str) -> Any:
    """Fetch a required key of a HF config (the first present of several spellings), or raise a CheckpointError."""
    keys = (key,) if isinstance(key, str) else key
    for k in keys:
        if hf_config.get(k) is not None:
            return hf_config[k]
    raise CheckpointError(f"{where}: config.json has no '{' or '.join(keys)}'")
