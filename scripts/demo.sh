#!/usr/bin/env bash
# The main job on CPU: set up (scripts/setup.sh), then train a small GPT with HDP on 4 gloo
# ranks on the embedded corpus (the Python standard library cut at top-level definitions:
# mostly short documents, a heavy tail of long ones; built once into ~/.cache/megatron_hdp),
# drawn by scripts/demo_corpus.json: 80% of the tokens from sequences that fit one rank.
# Extra arguments are passed to pretrain_hdp.py and override these. Every 5 steps the log
# shows `ranks/seq mean X max Y`: short sequences packed on one rank, long ones on rings.
# The run summary compares the step time and ring traffic with the static DP 2 x CP 2
# mesh's on the same batches (it shards every sequence over 2 ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The run folder (checkpoints, metrics.jsonl, tensorboard/, timelines/); run_cpu.sh uses it.
export OUT="${OUT:-runs/cpu-$(date +%Y%m%d-%H%M%S)}"
bash scripts/run_cpu.sh "$@"
# Pictures of the run (per-rank timeline of a step, loss and tokens/s) in $OUT/pictures/.
.venv/bin/python -m megatron_hdp.plot "$OUT"
