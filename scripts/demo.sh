#!/usr/bin/env bash
# Set up (scripts/setup.sh), then train a small GPT with HDP on 4 CPU ranks.
# Extra arguments go to scripts/hdp_demo.py (see --help there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node "${NPROC:-4}" \
  scripts/hdp_demo.py "$@"
