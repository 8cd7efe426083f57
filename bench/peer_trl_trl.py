"""TRL side of `bench/peer_trl.py`: TRL's GRPOTrainer on the prompts and settings the driver wrote.

    bench/.venv-trl/bin/python bench/peer_trl_trl.py SPEC.json OUT.json

Runs in the benchmark's own venv (TRL 1.16.0 and the CPU build of torch; neither megatron-rl nor its
dependencies are imported here). SPEC holds the model folder, the prompts (plain text: megatron-rl feeds the
built-in tasks' prompts without a chat template, and TRL tokenizes a non-conversational prompt with the
tokenizer's own call, so both sides see the same token ids; checked below), the seed, steps and batch settings.
OUT gets one record per optimizer step: seconds since the trainer was built, mean reward and completion tokens.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def _digit_count(text: str) -> int:
    return sum(1 for c in text if c.isascii() and c.isdigit())


def count_reward(prompts, completions, **kwargs) -> list[float]:
    """megatron-rl's `count` reward re-implemented identically (megatron_rl/rollout/tasks.py, `CountTask.reward`
    with `task.length` 8): min(number of ASCII digit characters in the response, 8) / 8."""
    target = 8
    return [min(_digit_count(text), target) / target for text in completions]


class StepLog(TrainerCallback):
    """Records per optimizer step: wall time, mean reward, completion tokens trained."""

    def __init__(self, completions_per_step: int):
        self.completions_per_step = completions_per_step
        self.start = time.perf_counter()
        self.records: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        """One log per step (logging_steps=1): the step's generation batch's metrics."""
        logs = logs or {}
        if "reward" not in logs:
            return
        tokens = logs["completions/mean_length"] * self.completions_per_step
        self.records.append({
            "step": state.global_step, "wall_s": time.perf_counter() - self.start, "reward": logs["reward"],
            "tokens": tokens, "mean_length": logs["completions/mean_length"],
        })  # fmt: skip
        print(f"[trl] step {state.global_step} reward {logs['reward']:.3f} t {self.records[-1]['wall_s']:.1f}s",
              file=sys.stderr, flush=True)  # fmt: skip


def check_prompt_ids(tokenizer, spec: dict) -> None:
    """TRL's tokenization of a plain-text prompt (`processing_class(text=...)`) must give megatron-rl's ids."""
    for record in spec["prompts"][:16]:
        ids = tokenizer(text=[record["prompt"]])["input_ids"][0]
        if list(ids) != record["prompt_ids"]:
            raise SystemExit(
                f"prompt ids differ for {record['prompt']!r}: TRL {ids} vs megatron-rl {record['prompt_ids']}"
            )


def grpo_config(spec: dict, out_dir: str) -> GRPOConfig:
    """The GRPOConfig matching megatron-rl's quickstart settings (see peer_trl.py's docstring)."""
    per_step = spec["prompts_per_step"] * spec["samples_per_prompt"]
    micro = spec["micro_batch_size"]
    return GRPOConfig(
        output_dir=out_dir, seed=spec["seed"], data_seed=spec["seed"], use_cpu=True, bf16=False, fp16=False,
        max_steps=spec["steps"], per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,
        num_generations=spec["samples_per_prompt"], max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        loss_type="dapo", scale_rewards="group", epsilon=spec["clip_low"], epsilon_high=spec["clip_high"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=spec["adam_beta2"], adam_epsilon=1e-8, max_grad_norm=spec["clip_grad"],
        router_aux_loss_coef=0.0, gradient_checkpointing=False, shuffle_dataset=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"},
    )  # fmt: skip


def main() -> None:
    """Train and write the step log."""
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    check_prompt_ids(tokenizer, spec)
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in spec["prompts"]])
    args = grpo_config(spec, spec["work_dir"])
    log = StepLog(spec["prompts_per_step"] * spec["samples_per_prompt"])
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=count_reward, args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[log],
    )  # fmt: skip
    log.start = time.perf_counter()  # model loading excluded, as megatron-rl's wall_s excludes it
    trainer.train()
    settings = {k: getattr(args, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
        "steps_per_generation", "num_generations", "max_completion_length", "loss_type", "scale_rewards",
        "learning_rate", "adam_beta2", "max_grad_norm", "temperature", "beta", "epsilon", "epsilon_high",
    )}  # fmt: skip
    Path(out_path).write_text(json.dumps({"records": log.records, "settings": settings}))


if __name__ == "__main__":
    main()
