#!/usr/bin/env bash
# Create .venv (if missing) and install megatron_hdp with its test tools, CPU torch included.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# pyproject.toml declares ranges (torch 2.11-2.13, megatron-core 0.16.x); constraints/ci.txt
# pins the exact versions CI tests. On these machines pip takes the CPU torch wheel from the
# local wheel folder; elsewhere use PIP_EXTRA_INDEX_URL to point at a CPU wheel index.
if ! log=$(.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints/ci.txt -e ".[dev]" 2>&1); then
  echo "$log" >&2
  echo "setup: pip install failed" >&2
  exit 1
fi
echo "$log" | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, megatron.core; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__)" 2>/dev/null
