#!/usr/bin/env bash
# CI's second lane: set up .venv312 (scripts/setup312.sh: Python 3.12, megatron-core 0.19.2,
# torch's CUDA build running on CPU), then the suites that meet Megatron there: the Megatron,
# distributed and end-to-end tests (the pure layer is lane 1's, and so is lint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup312.sh
if [ $# -gt 0 ]; then
  exec .venv312/bin/python -m pytest "$@"
fi
# The custom-loop example runs in a pytest process of its own: on megatron-core 0.19.2, after
# the Megatron tests before it in the same process, its forked ranks hang (state the parent
# keeps; alone it passes in seconds). Found the day the lane was added; not yet understood.
example=tests/megatron/test_custom_loop_example.py
.venv312/bin/python -m pytest tests/megatron tests/distributed tests/e2e --deselect "$example"
.venv312/bin/python -m pytest "$example"
