"""`megatron-rl verify parity`: the same token batch through Megatron (at a layout) and HF transformers."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl.models import family_for_hf_config, read_hf_config
from megatron_rl.parallel.layout import ParallelLayout, check_layout_fits_model
from megatron_rl.parallel.torchrun import run_torchrun

WORKER = "megatron_rl.tools.parity_worker"


def parity_tokens(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """A fixed random token batch [batch, seq] (seeded, so both sides see the same)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def hf_logprobs(hf_dir: str | Path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Log-probs [batch, seq-1] of tokens[:, 1:] under the checkpoint loaded by transformers' own model class."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def megatron_logprobs(
    hf_dir: str, layout: ParallelLayout, tokens: torch.Tensor, timeout_s: float = 900.0, mcore_dir: str | None = None
) -> tuple[torch.Tensor, float]:
    """Megatron's logprobs of `tokens` at `layout` (from the HF folder, or `mcore_dir` when given), and seconds."""
    with tempfile.TemporaryDirectory(prefix="mrl-parity-") as tmp:
        spec = {"hf": str(hf_dir), "mcore": mcore_dir and str(mcore_dir), "layout": layout.__dict__,
                "tokens": str(Path(tmp) / "tokens.pt"), "out": str(Path(tmp) / "mcore.pt")}  # fmt: skip
        torch.save(tokens, spec["tokens"])
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        start = time.perf_counter()
        run_torchrun(WORKER, [str(Path(tmp) / "spec.json")], layout.world_size, timeout_s)
        return torch.load(spec["out"]), time.perf_counter() - start


def run_parity(
    hf_dir: str, layout: ParallelLayout, batch: int = 4, seq: int = 160, timeout_s: float = 900.0, mcore_dir: str | None = None
) -> dict:
    """Run the comparison and return the report dictionary.

    With `mcore_dir`, Megatron loads that distributed checkpoint (saved at any layout) instead of the HF weights;
    the reference is still transformers on `hf_dir`.
    """
    hf_config = read_hf_config(hf_dir)
    family = family_for_hf_config(hf_config, where=f"{hf_dir}/config.json")
    arch = family.arch_from_hf(hf_config)
    check_layout_fits_model(layout, arch)
    tokens = parity_tokens(arch.vocab_size, batch, seq)
    reference = hf_logprobs(hf_dir, tokens)
    mcore, seconds = megatron_logprobs(hf_dir, layout, tokens, timeout_s, mcore_dir)
    diff = (mcore.double() - reference.double()).abs()
    return {
        "family": family.name,
        "source": "mcore" if mcore_dir else "hf",
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "num_tokens": int(diff.numel()),
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "mean_logprob": float(reference.mean()),
        "megatron_seconds": round(seconds, 2),
    }
