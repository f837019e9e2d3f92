#!/usr/bin/env bash
# Launch pretrain_hdp.py on this machine's CPU with torchrun (gloo). No set-up step.
#   NPROC=4 OUT=runs/x bash scripts/run_cpu.sh [pretrain_hdp.py flags...]   (later flags win)
# VENV_DIR picks the environment (default .venv; CI's Python 3.12 lane uses .venv312).
# Flags are validated once (--hdp-validate-only) before torchrun starts the ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-4}"
OUT="${OUT:-runs/cpu-$(date +%Y%m%d-%H%M%S)}"  # a new folder per run
VENV_DIR="${VENV_DIR:-.venv}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# On the embedded corpus (median document 499 bytes = tokens) a capacity of 2048 tokens packs
# most sequences whole on one rank; the tail gets rings of 2-4 ranks, cut at 4096 tokens. The
# static mesh to compare with is then DP 2 x CP 2 (at capacity 1024 it would be DP 1 x CP 4,
# one group with nothing to balance).
ARGS=(
  --num-layers 2 --hidden-size 64 --num-attention-heads 4
  --group-query-attention --num-query-groups 2
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --seq-length 4096 --hdp-capacity 2048 --hdp-global-batch-tokens 16384
  --train-iters 30 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 3
  --log-interval 5 --eval-interval 15 --eval-iters 2
  --save "$OUT/checkpoints" --save-interval 15
  --tensorboard-dir "$OUT/tensorboard" --hdp-metrics-file "$OUT/metrics.jsonl"
  "$@"
)
# Validate once, before torchrun: bad input ends here with status 2 and one line (torchrun
# would report every rank's exit and return 1).
WORLD_SIZE="$NPROC" "$VENV_DIR/bin/python" pretrain_hdp.py "${ARGS[@]}" --hdp-validate-only
mkdir -p "$OUT"
exec "$VENV_DIR/bin/torchrun" --standalone --nproc-per-node "$NPROC" pretrain_hdp.py "${ARGS[@]}"
