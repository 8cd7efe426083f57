"""The trainer's logprobs under the engines' top-k / top-p mask (`trainer/logprobs.masked_logprobs`), on gloo
processes at TP2 (each rank holds half of the vocabulary: the kept set needs the gathered rows), against an
unsharded reference: transformers' logits through `algorithms/sampling_mask.masked_log_softmax`. (TP1 against
TP2 through whole train steps: `test_train_step.py`.)

The tokens are sampled from that masked distribution (temperature 0.7, top-k 16, top-p 0.9), as an engine
samples them, so every response token is inside the kept set; without the mask the trainer's logprobs are
those of the whole tempered distribution, lower by the log of the kept mass."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.sampling_mask import KEEP_ALL, SamplingMask, masked_log_softmax
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.verify.parity import hf_logprobs, megatron_logprobs_many
from tests.support.hf_routes import perturbed_copy

TEMPERATURE = 0.7
MASK = SamplingMask(top_k=16, top_p=0.9)
PROMPT, NEW, ROWS = 8, 24, 4
TOLERANCE = 1e-5
MOVED_NOISE = 0.1
"""Noise (x each weight's std) that stands for the policy's updates since the tokens were sampled."""


def sample_masked(hf_dir: str, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[ROWS, PROMPT + NEW]` random prompts continued by sampling from transformers' masked distribution, the
    kept set of every position `[ROWS, PROMPT + NEW - 1, top_k]` as `TrainBatch.kept_tokens` lays it out)."""
    from transformers import AutoModelForCausalLM  # seconds to import

    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(3, vocab, (ROWS, PROMPT), generator=gen)
    kept = torch.full((ROWS, PROMPT + NEW - 1, MASK.top_k), -1, dtype=torch.int32)
    kept[:, : PROMPT - 1, 0] = KEEP_ALL
    with torch.no_grad():
        for step in range(NEW):
            logits = model(input_ids=tokens).logits[:, -1].float()
            probs = masked_log_softmax(logits, TEMPERATURE, MASK.top_k, MASK.top_p).exp()
            for row in range(ROWS):
                ids = (probs[row] > 0).nonzero().squeeze(-1)
                kept[row, PROMPT - 1 + step, : ids.numel()] = ids
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return tokens, kept


def moved_reference(hf_dir: str, tokens: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`[ROWS, S-1]` float64: the logprobs of `tokens` under `hf_dir`'s tempered logits masked to the given
    kept sets (the sampler's, not the sets these weights would keep), renormalised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()  # its MoE takes no float64
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[:, :-1].double() / TEMPERATURE
    keep = torch.zeros(*logits.shape[:-1], logits.shape[-1] + 1, dtype=torch.bool)  # last column: the padding's
    keep.scatter_(-1, torch.where(kept >= 0, kept.long(), logits.shape[-1]), True)
    keep = keep[..., :-1]
    logp = logits.masked_fill(~keep, float("-inf")).log_softmax(-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def results(tiny_dir, tmp_path_factory):
    """Reference and Megatron logprobs of the response tokens at TP2, masked and unmasked (one launch)."""
    from megatron_rl.models import read_hf_config

    hf = tiny_dir("qwen3_moe")
    tokens, kept = sample_masked(hf, read_hf_config(hf)["vocab_size"])
    moved = perturbed_copy(hf, tmp_path_factory.mktemp("moved") / "hf", MOVED_NOISE, seed=1)
    cases = [(hf, ParallelLayout(tp=2), None)] * 2 + [(moved, ParallelLayout(tp=2), None)]
    got, _ = megatron_logprobs_many(
        cases, [tokens] * 3, temperature=TEMPERATURE, mask=[MASK, SamplingMask(), MASK], kept=[None, None, kept]
    )
    response = slice(PROMPT - 1, None)  # position t predicts token t + 1
    reference = hf_logprobs(hf, tokens, temperature=TEMPERATURE, mask=MASK)[:, response]
    plain = hf_logprobs(hf, tokens, temperature=TEMPERATURE)[:, response]
    return {
        "reference": reference.double(),
        "plain_reference": plain.double(),
        "tp2": got[0][:, response].double(),
        "tp2_unmasked": got[1][:, response].double(),
        "moved_tp2": got[2][:, response].double(),
        "moved_reference": moved_reference(str(moved), tokens, kept)[:, response],
        "moved_own_sets": hf_logprobs(str(moved), tokens, temperature=TEMPERATURE, mask=MASK)[:, response],
    }


def test_masked_logprobs_match_the_unsharded_reference_at_tp2(results):
    reference = results["reference"]
    assert reference.numel() == ROWS * NEW and bool(torch.isfinite(reference).all())  # sampled: inside the set
    diff = float((results["tp2"] - reference).abs().max())
    print(f"TP2 masked vs reference: max |diff| {diff:.3g}")
    assert diff <= TOLERANCE


def test_without_the_mask_the_logprobs_are_biased_low(results):
    """The unmasked logprob of a kept token is its masked one plus the log of the kept mass (< 0): every token
    is biased, by as much as the tail the engine never samples from."""
    bias = results["tp2_unmasked"] - results["reference"]
    print(f"TP2 unmasked vs masked reference: max |diff| {float(bias.abs().max()):.3g}, mean {float(bias.mean()):.3g}")
    assert float((results["tp2_unmasked"] - results["plain_reference"]).abs().max()) <= TOLERANCE
    assert float(bias.max()) < 0 and float(bias.mean()) < -0.1, float(bias.mean())


def test_a_stale_sample_is_masked_to_the_samplers_set_not_the_trainers(results):
    """The trainer moved since sampling (every weight perturbed): with the sampler's kept sets its logprobs are
    those of its own logits on exactly those sets (no sampled token outside), while the sets its own logits
    would keep miss some of the sampled tokens (the bias the engine's sets remove)."""
    moved, reference = results["moved_tp2"], results["moved_reference"]
    assert bool(torch.isfinite(reference).all()) and bool(torch.isfinite(moved).all())
    diff = float((moved - reference).abs().max())
    missed = int(torch.isneginf(results["moved_own_sets"]).sum())
    print(f"moved TP2 on the sampler's sets vs reference: max |diff| {diff:.3g}; own sets miss {missed}/{ROWS * NEW}")
    assert diff <= TOLERANCE
    assert missed > 0
