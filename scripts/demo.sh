#!/usr/bin/env bash
# The main job on CPU: set up (scripts/setup.sh), then train a small GPT with HDP on 4 gloo
# ranks on the embedded corpus (the Python standard library, built once into
# ~/.cache/megatron_hdp). Extra arguments are passed to pretrain_hdp.py and override these.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/run_cpu.sh "$@"
