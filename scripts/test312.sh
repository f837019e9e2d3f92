#!/usr/bin/env bash
# CI's second lane: set up .venv312 (scripts/setup312.sh: Python 3.12, megatron-core 0.19.2,
# torch's CUDA build running on CPU), then run the whole test suite there. Lint is lane 1's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup312.sh
.venv312/bin/python -m pytest "$@"
