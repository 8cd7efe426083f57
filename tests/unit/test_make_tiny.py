"""Tiny checkpoints look like trained ones where it matters to training: no all-zero embedding rows."""

from __future__ import annotations

import pytest
from safetensors import safe_open


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "qwen3"])
def test_no_embedding_row_is_zero(family, tiny_dir):
    """transformers zeroes the pad row; a sampled pad token then spiked the grad norm ~1000x (RMSNorm at 0)."""
    from pathlib import Path

    folder = Path(tiny_dir(family))
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                rows = f.get_tensor("model.embed_tokens.weight").norm(dim=1)
                break
    else:
        pytest.fail(f"no model.embed_tokens.weight in {folder}")
    assert rows.min() > 0.1, f"embedding row {int(rows.argmin())} has norm {float(rows.min())}"


def test_tiny_tokenizer_renders_chat_messages(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir("qwen3"))
    text = tok.apply_chat_template([{"role": "user", "content": "2 + 3 ="}], tokenize=False, add_generation_prompt=True)
    assert text == "user: 2 + 3 =\nassistant: "
