#!/usr/bin/env python3
"""Convert a checkpoint between Hugging Face safetensors and Megatron's distributed format, at any layout.

    python tools/checkpoint/convert.py hf-to-mcore --hf HF_DIR --out MCORE_DIR --tp 2 --pp 2 --ep 2
    python tools/checkpoint/convert.py mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--tp/--pp/--ep to load with]

The same as `megatron-rl convert ...` (see `--help`); this script is for operators who keep conversion tools
beside the package, as Megatron-LM's tools/checkpoint/ does.
"""

import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
