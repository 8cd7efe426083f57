#!/usr/bin/env python3
"""Verify a checkpoint: Megatron's logprobs at a layout against transformers', or two HF checkpoints tensor by
tensor.

    python tools/checkpoint/verify.py parity --hf HF_DIR --tp 2 --ep 2 [--mcore MCORE_DIR] --json
    python tools/checkpoint/verify.py roundtrip HF_DIR OTHER_HF_DIR --json

The same as `megatron-rl verify parity|roundtrip ...`; exits 1 when the check fails, 2 on bad input.
"""

import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
