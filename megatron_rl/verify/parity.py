"""`megatron-rl verify parity`: the same token batch through Megatron (at a layout) and HF transformers."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl.algorithms.sampling_mask import SamplingMask, masked_log_softmax
from megatron_rl.models import family_for_hf_config, read_hf_config
from megatron_rl.parallel.layout import ParallelLayout, check_layout_fits_model
from megatron_rl.parallel.torchrun import run_torchrun

WORKER = "megatron_rl.workers.parity"


def parity_tokens(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """A fixed random token batch [batch, seq] (seeded, so both sides see the same)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def hf_logprobs(
    hf_dir: str | Path,
    tokens: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    temperature: float = 1.0,
    mask: SamplingMask | None = None,
) -> torch.Tensor:
    """Log-probs [batch, seq-1] of tokens[:, 1:] under the checkpoint loaded by transformers' own model class (its
    logits divided by `temperature`, and with `mask` restricted to the engines' top-k / top-p set: -inf outside)."""
    from transformers import AutoModelForCausalLM  # seconds to import; the torchrun workers use this module without it

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    mask = mask or SamplingMask()
    logp = masked_log_softmax(logits[:, :-1], temperature, mask.top_k, mask.top_p)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


ParityCase = tuple  # (hf_dir, ParallelLayout, mcore_dir or None)


def megatron_logprobs_many(
    cases: list[ParityCase],
    tokens: list[torch.Tensor],
    timeout_s: float = 900.0,
    temperature: float = 1.0,
    mask: SamplingMask | list[SamplingMask] | None = None,
    kept: list[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor], float]:
    """Megatron's logprobs for each (hf_dir, layout, mcore_dir) case (logits divided by `temperature`, for HF
    cases, and under the engines' top-k / top-p `mask` when given: one for every case or one per case, on the
    engine's kept sets `kept` of a case where given, `[B, S-1, K]` as `TrainBatch.kept_tokens`); one torchrun
    launch per world size."""
    masks = mask if isinstance(mask, list) else [mask or SamplingMask()] * len(cases)
    results: list[torch.Tensor | None] = [None] * len(cases)
    seconds = 0.0
    with tempfile.TemporaryDirectory(prefix="mrl-parity-") as tmp:
        by_world: dict[int, list[dict]] = {}
        kept = kept or [None] * len(cases)
        for i, ((hf_dir, layout, mcore_dir), toks, m) in enumerate(zip(cases, tokens, masks, strict=True)):
            torch.save(toks, Path(tmp) / f"tokens{i}.pt")
            if kept[i] is not None:
                torch.save(kept[i], Path(tmp) / f"kept{i}.pt")
            by_world.setdefault(layout.world_size, []).append(
                {"hf": str(hf_dir), "mcore": mcore_dir and str(mcore_dir), "layout": layout.__dict__,
                 "temperature": temperature, "top_k": m.top_k, "top_p": m.top_p,
                 "tokens": str(Path(tmp) / f"tokens{i}.pt"),
                 "kept": None if kept[i] is None else str(Path(tmp) / f"kept{i}.pt"), "out": str(Path(tmp) / f"out{i}.pt"), "index": i}
            )  # fmt: skip
        for world, world_cases in sorted(by_world.items()):
            spec_path = Path(tmp) / f"spec{world}.json"
            spec_path.write_text(json.dumps({"cases": world_cases}))
            start = time.perf_counter()
            run_torchrun(WORKER, [str(spec_path)], world, timeout_s * len(world_cases))
            seconds += time.perf_counter() - start
            for case in world_cases:
                results[case["index"]] = torch.load(case["out"])
    return results, seconds


def megatron_logprobs(
    hf_dir: str, layout: ParallelLayout, tokens: torch.Tensor, timeout_s: float = 900.0, mcore_dir: str | None = None
) -> tuple[torch.Tensor, float]:
    """Megatron's logprobs of `tokens` at `layout` (from the HF folder, or `mcore_dir` when given), and seconds."""
    results, seconds = megatron_logprobs_many([(hf_dir, layout, mcore_dir)], [tokens], timeout_s)
    return results[0], seconds


def run_parity_many(cases: list[ParityCase], batch: int = 4, seq: int = 160, timeout_s: float = 900.0) -> list[dict]:
    """Compare Megatron with transformers for each (hf_dir, layout, mcore_dir) case; one report per case.

    With a `mcore_dir`, Megatron loads that distributed checkpoint (saved at any layout) instead of the HF
    weights; the reference is still transformers on `hf_dir`.
    """
    prepared, references, tokens = [], {}, []
    for hf_dir, layout, _ in cases:
        hf_config = read_hf_config(hf_dir)
        family = family_for_hf_config(hf_config, where=f"{hf_dir}/config.json")
        arch = family.arch_from_hf(hf_config, f"{hf_dir}/config.json")
        check_layout_fits_model(layout, arch)
        toks = parity_tokens(arch.vocab_size, batch, seq)
        if str(hf_dir) not in references:
            references[str(hf_dir)] = hf_logprobs(hf_dir, toks)
        prepared.append(family.name)
        tokens.append(toks)
    results, seconds = megatron_logprobs_many(cases, tokens, timeout_s)
    reports = []
    for (hf_dir, layout, mcore_dir), family, mcore in zip(cases, prepared, results):
        reference = references[str(hf_dir)]
        diff = (mcore.double() - reference.double()).abs()
        reports.append(
            {
                "family": family,
                "source": "mcore" if mcore_dir else "hf",
                "layout": layout.describe(),
                "world_size": layout.world_size,
                "num_tokens": int(diff.numel()),
                "max_abs_logprob_diff": float(diff.max()),
                "mean_abs_logprob_diff": float(diff.mean()),
                "mean_logprob": float(reference.mean()),
                "megatron_seconds": round(seconds, 2),
            }
        )
    return reports


def run_parity(
    hf_dir: str,
    layout: ParallelLayout,
    batch: int = 4,
    seq: int = 160,
    timeout_s: float = 900.0,
    mcore_dir: str | None = None,
) -> dict:
    """Compare Megatron at `layout` with transformers on one token batch; the report dictionary."""
    return run_parity_many([(hf_dir, layout, mcore_dir)], batch, seq, timeout_s)[0]
