#!/usr/bin/env bash
# The property tests (pytest -m property), long and random: hypothesis's "long" profile
# (tests/property.py) draws a fresh seed each run and 50x the suite's examples, where the
# suite runs them derandomized (a fixed seed). Run it before resolving an issue that touches
# the planner. Extra arguments go to pytest, e.g. a file, -k, or -x; HDP_PROPERTY_SCALE=<n>
# sets the example scale instead of 50. A failure prints the falsifying example and a
# @reproduce_failure blob that replays it.
set -euo pipefail
cd "$(dirname "$0")/.."
export HDP_PROPERTY_PROFILE=long
exec .venv/bin/python -m pytest -m property -p no:cacheprovider --durations=0 "$@"
