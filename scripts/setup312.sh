#!/usr/bin/env bash
# Create .venv312 (if missing) with Python 3.12 and install megatron_hdp with its test tools:
# CI's second lane (constraints/ci312.txt: megatron-core 0.19.2, torch's CUDA build on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "setup312: no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
  return 1
}
if [ ! -x .venv312/bin/python ]; then
  python312=$(find_python312)
  "$python312" -m venv .venv312
fi
if ! log=$(.venv312/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints/ci312.txt -e ".[dev]" 2>&1); then
  echo "$log" >&2
  echo "setup312: pip install failed" >&2
  exit 1
fi
echo "$log" | grep -v "^WARNING: Location" || true
.venv312/bin/python -c "import torch, megatron.core; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__)" 2>/dev/null
