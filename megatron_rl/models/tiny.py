"""`megatron-rl make-tiny`: a small random Hugging Face checkpoint of a family, with a shipped BPE tokenizer."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from megatron_rl.models import get_family
from megatron_rl.models.hf_checkpoint import check_output_folder, staging_folder

TINY_VOCAB = 512
_CORPUS_TEXT = (
    "the a of to and in is it that for on with as was at by an be this from or are not have one all which "
    "you were her she there been if would their we him when who will more no out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three plus minus times equals "
    "answer sum number "
)
_CORPUS_WORDS = _CORPUS_TEXT.split()


def training_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic English-like text plus arithmetic, enough for a byte-level BPE of 512 tokens."""

    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(4, 14))]
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append(" ".join(words) + f" {a} + {b} = {a + b}." if i % 3 else " ".join(words).capitalize() + ".")
    return out


def build_tokenizer(vocab_size: int = TINY_VOCAB):
    """Train a byte-level BPE tokenizer offline (milliseconds) with `<|pad|>`, `<|bos|>`, `<|eos|>`."""

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A plain `role: content` chat template, so that chat-message datasets work with the tiny models too."""


def save_tokenizer(out: Path, vocab_size: int = TINY_VOCAB) -> None:
    """Write tokenizer.json + tokenizer_config.json (with a chat template) that `AutoTokenizer` and vLLM load."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size), bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def perturb_for_testing(model, seed: int) -> None:
    """Make norms and biases non-trivial so that a mis-mapped one changes the output."""

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias") or "e_score_correction_bias" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def fill_padding_embeddings(model, seed: int, std: float) -> int:
    """Give the padding token's input-embedding row random values like every other row; returns rows filled.

    transformers zeroes the `padding_idx` row at initialisation. A zero embedding reaches the first RMSNorm as a
    zero vector, whose gradient there is 1/sqrt(eps) (1000x at eps 1e-6): whenever an engine sampled the pad
    token, that one token's embedding gradient made the step's grad norm ~1000x the usual (1567 against ~1.7 in
    the quickstart). A trained checkpoint has no zero rows, so the tiny one should not either.
    """

    embedding = model.get_input_embeddings()
    pad = getattr(embedding, "padding_idx", None)
    if pad is None:
        return 0
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        embedding.weight[pad].copy_(std * torch.randn(embedding.weight.shape[1], generator=gen))
    return 1


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside the block, as they were afterwards."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def make_tiny(
    family_name: str, out: str | Path, seed: int = 0, overrides: dict | None = None, overwrite: bool = False
) -> Path:
    """Create a random HF checkpoint of `family_name` in `out` and return its path."""
    family = get_family(family_name)
    check_output_folder(out, overwrite)  # before building the model, not after
    cfg = family.tiny_hf_config(TINY_VOCAB)
    cfg.update(initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(overrides or {})
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_for_testing(model, seed)
    fill_padding_embeddings(model, seed, std=cfg["initializer_range"])
    out = Path(out)
    with staging_folder(out, overwrite=overwrite) as tmp:
        with _no_progress_bars():  # a tiny model: a bar would only clutter the console of the run that makes it
            model.save_pretrained(str(tmp), safe_serialization=True)
        save_tokenizer(tmp, int(cfg.get("vocab_size", TINY_VOCAB)))
        meta = {"family": family.name, "seed": seed}
        (tmp / "megatron_rl_tiny.json").write_text(json.dumps(meta) + "\n")
    return out
