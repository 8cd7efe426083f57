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

from megatron_rl.algorithms.sampling_mask import SamplingMask, masked_log_softmax
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.verify.parity import hf_logprobs, megatron_logprobs_many

TEMPERATURE = 0.7
MASK = SamplingMask(top_k=16, top_p=0.9)
PROMPT, NEW, ROWS = 8, 24, 4
TOLERANCE = 1e-5


def sample_masked(hf_dir: str, vocab: int, seed: int = 0) -> torch.Tensor:
    """`[ROWS, PROMPT + NEW]`: random prompts continued by sampling from transformers' masked distribution."""
    from transformers import AutoModelForCausalLM  # seconds to import

    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(3, vocab, (ROWS, PROMPT), generator=gen)
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(input_ids=tokens).logits[:, -1].float()
            probs = masked_log_softmax(logits, TEMPERATURE, MASK.top_k, MASK.top_p).exp()
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return tokens


@pytest.fixture(scope="module")
def results(tiny_dir):
    """Reference and Megatron logprobs of the response tokens at TP2, masked and unmasked (one launch)."""
    from megatron_rl.models import read_hf_config

    hf = tiny_dir("qwen3_moe")
    tokens = sample_masked(hf, read_hf_config(hf)["vocab_size"])
    cases = [(hf, ParallelLayout(tp=2), None)] * 2
    got, _ = megatron_logprobs_many(cases, [tokens] * 2, temperature=TEMPERATURE, mask=[MASK, SamplingMask()])
    response = slice(PROMPT - 1, None)  # position t predicts token t + 1
    reference = hf_logprobs(hf, tokens, temperature=TEMPERATURE, mask=MASK)[:, response]
    plain = hf_logprobs(hf, tokens, temperature=TEMPERATURE)[:, response]
    return {
        "reference": reference.double(),
        "plain_reference": plain.double(),
        "tp2": got[0][:, response].double(),
        "tp2_unmasked": got[1][:, response].double(),
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
