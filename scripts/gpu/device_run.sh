#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (docs/gpu.md, "The first GPU run").
#
#   bash scripts/gpu/device_run.sh                  # on the GPU machine
#   bash scripts/gpu/device_run.sh --cpu            # the dry run, here, on CPU
#
# What it does, in order, every step logged to "$OUT/device_run.log":
#   1. says what the machine has (python, torch, CUDA, numpy, packaging, megatron-core,
#      flash-attn, the GPU, free memory and disk);
#   2. installs the wheels carried in $WHEELS (default .whl: megatron-core for cp312, which
#      the GPU image lacks) into a folder of their own with --no-deps, so the image's torch,
#      numpy and packaging stay as they are, and puts that folder on PYTHONPATH;
#   3. runs `verify.py --quick`, then the full `verify.py` with the seconds left of
#      $BUDGET_S (default 420: a 7-minute call), each with --budget-s so that it plans its
#      sections to fit and never starts one it cannot finish, and each writing its JSON to
#      $OUT after every section.
# $VERIFY_ARGS is added to every verify call (e.g. "--sections env,kernels" for a short
# dry run). Exit status: the worst of the verify runs (0 all passed, 1 a check failed, 3 a section
# crashed or timed out, 4 the install failed). $OUT defaults to results/gpu/device-run.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then
  MODE=cpu
  shift
fi
OUT="${OUT:-results/gpu/device-run}"
WHEELS="${WHEELS:-.whl}"
BUDGET_S="${BUDGET_S:-420}"
PYTHON="${PYTHON:-python3}"
SITE="${SITE:-/tmp/hdp-site}"
mkdir -p "$OUT"
LOG="$OUT/device_run.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
SECONDS=0
say() { echo "device_run [${SECONDS}s] $*"; }

say "mode $MODE, budget ${BUDGET_S}s, out $OUT, wheels $WHEELS"
"$PYTHON" - <<'EOF'
import importlib.metadata as md
import platform
import shutil
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"

print("python", sys.version.split()[0], platform.machine())
for name in ("torch", "numpy", "packaging", "megatron-core", "flash-attn", "flash-attn-4",
             "transformer-engine"):
    print(f"  {name:20s} {version(name)}")
try:
    import torch
    print("  cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        print(f"  gpu {torch.cuda.get_device_name()} free {free / 2**30:.1f} of "
              f"{total / 2**30:.1f} GiB")
except Exception as exc:  # the log must say why, and the script goes on to say more
    print("  torch import failed:", exc)
print(f"  disk free {shutil.disk_usage('.').free / 2**30:.1f} GiB")
EOF

status=0
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  say "installing $(ls "$WHEELS"/*.whl | xargs -n1 basename | tr '\n' ' ')into $SITE (--no-deps)"
  rm -rf "$SITE"
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --disable-pip-version-check --target "$SITE" "$WHEELS"/*.whl; then
    say "the install failed; verify runs without the carried wheels"
    status=4
  else
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
else
  say "no wheels in $WHEELS: the train section needs megatron-core and will say so"
fi
"$PYTHON" -c "import megatron.core as m; print('megatron-core', m.__version__, 'from', m.__file__)" \
  2>/dev/null || say "megatron-core does not import"

run_verify() {  # name, budget seconds, extra verify flags...
  local name=$1 budget=$2
  shift 2
  say "verify $name: --budget-s $budget $*"
  # shellcheck disable=SC2086  # VERIFY_ARGS is a word list on purpose
  "$PYTHON" scripts/gpu/verify.py "$@" ${VERIFY_ARGS:-} --budget-s "$budget" \
    --out "$OUT/verify-$name.json"
  local rc=$?
  say "verify $name exited $rc"
  [ "$rc" -gt "$status" ] && status=$rc
}

if [ "$MODE" = cpu ]; then
  run_verify cpu "$BUDGET_S" --cpu
else
  quick_budget=$((BUDGET_S < 150 ? BUDGET_S : 150))
  run_verify quick "$((quick_budget - SECONDS > 30 ? quick_budget - SECONDS : 30))" --quick
  left=$((BUDGET_S - SECONDS - 15))
  if [ "$left" -ge 60 ]; then
    run_verify full "$left"
  else
    say "only ${left}s left: the full run is skipped"
  fi
fi
say "done, status $status; files: $(ls "$OUT" | tr '\n' ' ')"
exit "$status"
