#!/usr/bin/env bash
# CI's third lane: Megatron-LM's own training loop with --hdp (tests/megatron_lm) on Python 3.12
# with megatron-core 0.19.2, which runs the core_v0.19.0 training tree from
# ../shared/third_party/ (lane 1 runs the same tests on core_v0.16.1). Reuses .venv312:
# scripts/setup312.sh creates it only if missing and otherwise re-runs the same pip install.
# HDP_MEGATRON_LM_TESTS names the tests to run instead of tests/megatron_lm (lane 3b:
# tests/megatron_lm/test_recipes.py).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=../shared/third_party/megatron-lm-core_v0.19.0
if [ ! -d "$tree" ]; then  # the tests would skip: a lane that tests nothing must not pass
  echo "test312_megatron_lm: $tree is missing (Megatron-LM's training tree, see its SOURCE.md)" >&2
  exit 1
fi
bash scripts/setup312.sh
exec .venv312/bin/python -m pytest "${HDP_MEGATRON_LM_TESTS:-tests/megatron_lm}" "$@"
