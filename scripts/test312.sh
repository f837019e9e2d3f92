#!/usr/bin/env bash
# CI's second lane: set up .venv312 (scripts/setup312.sh: Python 3.12, megatron-core 0.19.2,
# torch's CUDA build running on CPU), then the suites that meet Megatron there: the Megatron,
# distributed and end-to-end tests (the pure layer is lane 1's, and so is lint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup312.sh
if [ $# -eq 0 ]; then
  set -- tests/megatron tests/distributed tests/e2e
fi
exec .venv312/bin/python -m pytest "$@"
