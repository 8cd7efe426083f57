"""Benchmark: TRL's GRPOTrainer and megatron-rl side by side, on the same model, task, batch and optimizer.

    .venv/bin/python bench/peer_trl.py [--seeds 3] [--trl-steps 260] [--mrl-steps 260] [--mrl-override k=v ...]
        [--trl-micro-batch 64] [--size tiny|wide]

Per seed, both sides load the same random 4-layer Qwen3-MoE folder (`make_tiny("qwen3_moe", ...,
num_hidden_layers=4)`, the 512-token BPE; `--size wide`: `bench/train_step.py`'s compute model, hidden 512 and
8 heads x 64, where the matmuls rather than per-op costs take the time) and learn the `count` task (prompt
`count: <3 words> =`, reward min(#digits, 8)/8) with 8 prompts x 8 samples per step, at most 8 new tokens,
temperature 1.0, Adam lr 3e-4 constant, betas (0.9, 0.99), eps 1e-8, no weight decay, grad clip 1.0, no KL, one
optimizer update per batch, fp32, GRPO advantages normalised within each group (mean and std), the loss a token
mean over the whole batch.

- megatron-rl: configs/quickstart.yaml as it is (async, max_staleness 4, EP2 trainer, its micro-batching,
  decoupled PPO with TIS, one vLLM engine), with `model.hf_path`, `steps`, `trainer.seed` and `task.seed` set
  (plus any `--mrl-override` of its own options: one that changes the settings both sides share is refused).
- TRL 1.16.0 (`bench/peer_trl_trl.py`, in its own venv `bench/.venv-trl`, made on first use: not a project
  dependency): GRPOTrainer in one process, HF `generate` (use_vllm False), loss_type "dapo" (token-level mean
  over the global accumulated batch, as our `token_mean`), scale_rewards "group", one generation batch of 64
  completions and one update, clip 0.2 / 0.28 as ours; per-device batch 64 (no gradient accumulation) by
  default, as the quickstart's trainer takes its share in one micro-batch (`--trl-micro-batch 8`: 8 x 8
  accumulation steps, the setting of the first comparisons). Each side's micro-batches per update are in
  its summary (`micro_batches`).

Printed (one JSON object on stdout; progress on stderr), per side and seed, then medians over seeds and ratios
(`tokens_per_s` mrl/trl, `s_to_0.9` trl/mrl): trained tokens/s = completion tokens trained in steps 2..N over
the seconds from the end of step 1 to the end of step N; seconds (from the end of step 1) and steps to the first
step whose 10-step trailing mean reward is >= 0.5 and >= 0.9 (null: never); mean reward over the last 60 s
(`reward_last_min`: the whole run when it is shorter).
Each side is timed from its first training step: model loading, engine start-up and compilation excluded.

Not the same on the two sides: megatron-rl generates asynchronously (batches up to 4 versions stale,
importance-corrected by TIS) in a vLLM engine beside a 2-rank trainer, TRL on-policy and synchronously in the
trainer's own process; TRL walks the prompt list in order, megatron-rl's buffer draws the same stream but drops
stale groups, so later prompts differ; the samplers' random streams differ (same seeds, different generators);
TRL's transformers is whatever trl==1.16.0 pulls (its venv), ours the project's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

import ray  # noqa: E402
from train_step import TINY, WIDE  # noqa: E402  (beside this file)

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.launcher import run_training  # noqa: E402
from megatron_rl.metrics.logger import is_step_record, read_metrics  # noqa: E402
from megatron_rl.models.tiny import make_tiny  # noqa: E402
from megatron_rl.rollout.tasks import CountTask, load_tokenizer  # noqa: E402

BENCH = Path(__file__).resolve().parent
TRL_VENV = BENCH / ".venv-trl"
TRL_SCRIPT = BENCH / "peer_trl_trl.py"
QUICKSTART = BENCH.parent / "configs" / "quickstart.yaml"
TRL_RUN_TIMEOUT_S = 3600
"""Longest one seed's TRL run may take (minutes here): past it the benchmark fails rather than hangs."""
THRESHOLDS = (0.5, 0.9)
WINDOW = 10  # steps of the trailing mean reward
LAST_S = 60.0  # "reward over the last minute"
SETTINGS = {
    "prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 8, "temperature": 1.0, "lr": 3e-4,
    "adam_beta2": 0.99, "clip_grad": 1.0, "clip_low": 0.2, "clip_high": 0.28,
}  # fmt: skip
"""What both sides use; the megatron-rl values come from configs/quickstart.yaml (`check_settings`, in `main`
before any run)."""


def say(message: str) -> None:
    """Progress line on stderr."""
    print(f"[peer_trl] {message}", file=sys.stderr, flush=True)


def ensure_trl_venv() -> Path:
    """The TRL venv's python, made on first use: the local CPU torch first (a bare torch would pull CUDA)."""
    python = TRL_VENV / "bin" / "python"
    probe = [str(python), "-c", "import trl, torch; assert trl.__version__ == '1.16.0', trl.__version__"]
    if python.exists() and subprocess.run(probe, capture_output=True, timeout=300).returncode == 0:
        return python
    say(f"making {TRL_VENV} (torch 2.13.0 CPU, trl 1.16.0)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True, timeout=300)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, stdout=sys.stderr, timeout=1800)
    subprocess.run([*pip, "trl==1.16.0"], check=True, stdout=sys.stderr, timeout=1800)
    subprocess.run(probe, check=True, timeout=300)
    return python


SIZES = {"tiny": TINY, "wide": WIDE}
"""`--size`: the model's config overrides (`train_step.py`'s quickstart and compute models)."""
MODEL_NAMES = {
    "tiny": "tiny qwen3_moe, 4 layers",
    "wide": "qwen3_moe, 4 layers, hidden 512 (train_step.py's compute model)",
}


def make_model(root: Path, seed: int, size: str = "tiny") -> Path:
    """The seed's random 4-layer Qwen3-MoE of `size` (HF folder with the project's tokenizer), shared by both
    sides; kept in `root` (a folder there of that name is used as it is)."""
    path = root / (f"model-seed{seed}" if size == "tiny" else f"model-{size}-seed{seed}")
    if not (path / "config.json").exists():
        make_tiny("qwen3_moe", path, seed=seed, overrides=SIZES[size])
    return path


def count_prompts(model: Path, seed: int, n: int) -> list[dict]:
    """The first `n` prompts of megatron-rl's `count` task stream (task.seed = `seed`, epoch 0), as it makes
    them: plain text, no chat template, `prompt_ids` = the tokenizer's own encoding of the text."""
    stream = CountTask(load_tokenizer(model), seed=seed).prompts(epoch=0)
    return [{"prompt": r["prompt"], "prompt_ids": r["prompt_ids"]} for r, _ in zip(stream, range(n))]


def check_settings(cfg, overrides: list[str]) -> None:
    """SystemExit naming what differs when megatron-rl's `cfg` (the quickstart with `overrides`) no longer has the
    settings the TRL side uses (`SETTINGS`): the comparison would not be of the same task and optimizer."""
    r, opt = cfg.rollout, cfg.trainer.optimizer
    actual = {"prompts_per_step": cfg.prompts_per_step, "samples_per_prompt": r.samples_per_prompt,
              "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "lr": opt.lr,
              "adam_beta2": opt.adam_beta2, "clip_grad": opt.clip_grad,
              "clip_low": cfg.algorithm.clip_low, "clip_high": cfg.algorithm.clip_high}  # fmt: skip
    differ = {key: (actual[key], SETTINGS[key]) for key in SETTINGS if actual[key] != SETTINGS[key]}
    if differ:  # (ours, TRL's)
        where = "--mrl-override" if overrides else "configs/quickstart.yaml"
        raise SystemExit(f"{where} makes megatron-rl's settings differ from the TRL side's: {differ}")


def run_mrl(model: Path, seed: int, steps: int, root: Path, overrides: list[str]) -> list[dict]:
    """One megatron-rl run of the quickstart on `model`; per step (end seconds, mean reward, tokens trained).
    What it sets beside `overrides` is none of the shared settings `main` checked before any run."""
    name = f"mrl-seed{seed}"
    cfg = load_config(str(QUICKSTART), [
        f"steps={steps}", f"name={name}", f"output_dir={root}", f"model.hf_path={model}", "model.make_tiny=false",
        f"trainer.seed={seed}", f"task.seed={seed}", *overrides,
    ])  # fmt: skip
    say(f"megatron-rl seed {seed}: {steps} steps in {root / name}")
    try:
        run_training(cfg)
    finally:  # the local Ray this run started would idle beside the next TRL run: its processes go with it
        ray.shutdown()
    records = [x for x in read_metrics(root / name / "metrics.jsonl") if is_step_record(x)]
    return [
        {"step": x["step"], "t": x["wall_s"], "reward": x["reward/mean"],
         "tokens": x.get("batch/response_tokens", x["rollout/tokens"]), "micro_batches": x["batch/micro_batches"]}
        for x in records
    ]  # fmt: skip


def run_trl(python: Path, model: Path, seed: int, steps: int, root: Path, micro: int) -> tuple[list[dict], dict]:
    """One TRL GRPOTrainer run (subprocess in the TRL venv) with micro-batches of `micro` completions; per step
    rows as `run_mrl`'s, and its settings."""
    work = root / f"trl-seed{seed}-mb{micro}"
    work.mkdir(parents=True, exist_ok=True)
    prompts = count_prompts(model, seed, steps * SETTINGS["prompts_per_step"])
    spec = {**SETTINGS, "model": str(model), "seed": seed, "steps": steps, "prompts": prompts, "work_dir": str(work),
            "micro_batch_size": micro}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    say(f"TRL seed {seed}: {steps} steps in {work}")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [str(python), str(TRL_SCRIPT), str(work / "spec.json"), str(work / "log.json")]
    subprocess.run(cmd, check=True, stdout=sys.stderr, env=env, cwd=str(work), timeout=TRL_RUN_TIMEOUT_S)
    log = json.loads((work / "log.json").read_text())
    per_update = SETTINGS["prompts_per_step"] * SETTINGS["samples_per_prompt"] // micro
    rows = [{"step": x["step"], "t": x["wall_s"], "reward": x["reward"], "tokens": x["tokens"],
             "micro_batches": per_update} for x in log["records"]]  # fmt: skip
    return rows, log["settings"]


def summarise(rows: list[dict]) -> dict:
    """Tokens/s, seconds and steps to each threshold, last-minute reward of one run (timed from step 1's end)."""
    t0 = rows[0]["t"]
    span = rows[-1]["t"] - t0
    out = {
        "steps": len(rows),
        "tokens_per_s": sum(r["tokens"] for r in rows[1:]) / span if span > 0 else None,
        "seconds": span,
        "micro_batches": statistics.fmean(r["micro_batches"] for r in rows),
        "reward_last_min": statistics.fmean(r["reward"] for r in rows if r["t"] >= rows[-1]["t"] - LAST_S),
    }
    for threshold in THRESHOLDS:
        out[f"s_to_{threshold}"] = out[f"steps_to_{threshold}"] = None
        for k in range(WINDOW - 1, len(rows)):
            if statistics.fmean(r["reward"] for r in rows[k - WINDOW + 1 : k + 1]) >= threshold:
                out[f"s_to_{threshold}"], out[f"steps_to_{threshold}"] = rows[k]["t"] - t0, rows[k]["step"]
                break
    return out


def median(values: list) -> float | None:
    """Median of the seeds' values, a null (never reached) counting as infinitely late; null if that is it."""
    if not values:  # a side left out (`--only`)
        return None
    m = statistics.median(float("inf") if v is None else v for v in values)
    return None if m == float("inf") else m


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, null when either is."""
    return round(a / b, 3) if a is not None and b else None


def compare(runs: dict[str, list[dict]]) -> dict:
    """Medians over seeds per side, and the ratios that the goal reads."""
    keys = ["tokens_per_s", "reward_last_min", *(f"{p}_to_{t}" for t in THRESHOLDS for p in ("s", "steps"))]
    med = {side: {k: median([s[k] for s in seeds]) for k in keys} for side, seeds in runs.items()}
    return {
        "median": med,
        "tokens_per_s_ratio_mrl_over_trl": ratio(med["mrl"]["tokens_per_s"], med["trl"]["tokens_per_s"]),
        "s_to_0.9_ratio_trl_over_mrl": ratio(med["trl"]["s_to_0.9"], med["mrl"]["s_to_0.9"]),
        "s_to_0.5_ratio_trl_over_mrl": ratio(med["trl"]["s_to_0.5"], med["mrl"]["s_to_0.5"]),
    }


def main() -> None:
    """Run both sides for every seed and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (model, task, trainer and sampler)")
    parser.add_argument("--trl-steps", type=int, default=260)
    parser.add_argument("--mrl-steps", type=int, default=260)
    parser.add_argument("--mrl-override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--only", choices=("trl", "mrl"), help="run one side only (its ratios are then null)")
    parser.add_argument("--work-dir", default="", help="keep models and runs here (default: a temporary folder)")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny", help="the model (module docstring)")
    whole = SETTINGS["prompts_per_step"] * SETTINGS["samples_per_prompt"]
    parser.add_argument(
        "--trl-micro-batch", type=int, default=whole,
        help=f"TRL's per-device batch (gradient accumulation makes up the {whole} completions of an update); default"
        " the whole update in one micro-batch, as the quickstart's trainer (micro_batch_tokens) takes it",
    )  # fmt: skip
    args = parser.parse_args()
    check_settings(load_config(str(QUICKSTART), args.mrl_override), args.mrl_override)  # before any run
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything else (Ray, vLLM, the launcher's console) goes to stderr: stdout is the JSON only
    python = ensure_trl_venv() if args.only != "mrl" else None
    with tempfile.TemporaryDirectory(prefix="mrl-bench-peer-trl-") as tmp:
        root = Path(args.work_dir or tmp).resolve()
        runs: dict[str, list[dict]] = {"mrl": [], "trl": []}
        settings = None
        for seed in range(args.seeds):
            model = make_model(root, seed, args.size)
            if args.only != "mrl":
                rows, settings = run_trl(python, model, seed, args.trl_steps, root, args.trl_micro_batch)
                runs["trl"].append(summarise(rows))
            if args.only != "trl":
                runs["mrl"].append(summarise(run_mrl(model, seed, args.mrl_steps, root / "runs", args.mrl_override)))
            say(f"seed {seed}: " + " | ".join(f"{side} {seeds[-1]}" for side, seeds in runs.items() if seeds))
    result = {
        "model": MODEL_NAMES[args.size], "task": "count", "seeds": args.seeds, "trl_steps": args.trl_steps,
        "mrl_steps": args.mrl_steps, "mrl_overrides": args.mrl_override, "settings": SETTINGS,
        "trl_settings": settings, **compare(runs), "per_seed": runs,
    }  # fmt: skip
    print(json.dumps(result), file=stdout, flush=True)


if __name__ == "__main__":
    main()
