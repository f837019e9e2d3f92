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
# The data: the embedded corpus (median document 499 bytes = tokens, a heavy tail cut at
# --seq-length) drawn by scripts/demo_corpus.json as 80% of the tokens from sequences that
# fit one rank (<= 2,048 tokens, the capacity) and 20% from longer ones, about 38 sequences
# per 24,576-token step. HDP packs the short ones whole on one rank and gives the long ones
# rings; the static mesh to compare with, DP 2 x CP 2, shards every sequence over 2 ranks.
# Giving --data-path or --hdp-data-spec replaces that spec.
DATA=(--hdp-data-spec scripts/demo_corpus.json)
for arg in "$@"; do
  case "$arg" in --data-path | --data-path=* | --hdp-data-spec | --hdp-data-spec=*) DATA=() ;; esac
done
ARGS=(
  --num-layers 2 --hidden-size 64 --num-attention-heads 4
  --group-query-attention --num-query-groups 2
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --seq-length 4096 --hdp-capacity 2048 --hdp-global-batch-tokens 24576 "${DATA[@]}"
  --train-iters 30 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 3
  --log-interval 5 --eval-interval 15 --eval-iters 2
  --save "$OUT/checkpoints" --save-interval 15
  --tensorboard-dir "$OUT/tensorboard" --hdp-metrics-file "$OUT/metrics.jsonl"
  "$@"
)
# Validate once, before torchrun: bad input ends here with status 2 and one line (torchrun
# would report every rank's exit and return 1).
WORLD_SIZE="$NPROC" LOCAL_WORLD_SIZE="$NPROC" "$VENV_DIR/bin/python" pretrain_hdp.py "${ARGS[@]}" --hdp-validate-only
mkdir -p "$OUT"
exec "$VENV_DIR/bin/torchrun" --standalone --nproc-per-node "$NPROC" pretrain_hdp.py "${ARGS[@]}"
