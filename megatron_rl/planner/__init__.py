"""`megatron-rl plan`: will a run config fit its cluster? Per-GPU memory of the trainer and of the engines.

Pure Python at the config layer (no torch, Megatron or vLLM): it reads the model's shape from its Hugging Face
`config.json` (`model.hf_config`, else `model.hf_path/config.json`, else with `model.make_tiny` the tiny model
that `make-tiny` would create for `model.family`) and the layouts from the run config, and estimates, per GPU,
the trainer's memory for every pipeline stage (`trainer.py`) and the engines' weights and KV-cache room
(`engines.py`), from parameter counts split by how each layout shards them (`params.py`). `planning.py` checks
the layouts against the model and the cluster and builds the `Plan`; `report.py` renders it.

Not modelled: DeepSeek-V3's multi-token-prediction layer (about 14B parameters in the published checkpoint; not
trained here, `num_nextn_predict_layers` is ignored), Megatron's vocabulary padding, context parallelism, optimizer
CPU offload, FP8. GPU memory is taken in decimal GB (10^9 bytes), which is a little conservative (an "80 GB" H100
has 85.5e9 bytes usable).
"""

from __future__ import annotations

from megatron_rl.planner.common import GB, PlanError
from megatron_rl.planner.engines import (
    ENGINE_OVERHEAD_BYTES,
    EnginePlan,
    check_engine_layout,
    kv_bytes_per_token,
    plan_engines,
)
from megatron_rl.planner.params import (
    ModelSize,
    Params,
    attention_params,
    embedding_params,
    head_params,
    layer_params,
    mlp_params,
    model_size,
    stage_params,
    topk,
)
from megatron_rl.planner.planning import TINY_VOCAB, check_cluster, load_model_config, plan
from megatron_rl.planner.report import Plan, format_plan
from megatron_rl.planner.trainer import (
    TRAINER_OVERHEAD_BYTES,
    StageMemory,
    TrainerPlan,
    layer_activation_bytes,
    logits_bytes,
    plan_trainer,
)

__all__ = [
    "ENGINE_OVERHEAD_BYTES",
    "GB",
    "TINY_VOCAB",
    "TRAINER_OVERHEAD_BYTES",
    "EnginePlan",
    "ModelSize",
    "Params",
    "Plan",
    "PlanError",
    "StageMemory",
    "TrainerPlan",
    "attention_params",
    "check_cluster",
    "check_engine_layout",
    "embedding_params",
    "format_plan",
    "head_params",
    "kv_bytes_per_token",
    "layer_activation_bytes",
    "layer_params",
    "load_model_config",
    "logits_bytes",
    "mlp_params",
    "model_size",
    "plan",
    "plan_engines",
    "plan_trainer",
    "stage_params",
    "topk",
]
