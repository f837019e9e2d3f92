#!/usr/bin/env bash
# Install Debian's SLURM daemons, client and munge (bookworm: SLURM 22.05), for
# scripts/slurm/local_slurm.sh and tests/e2e/test_slurm.py. Needs root and apt-get; exits 0 at
# once when everything is already installed, 1 with a message when it cannot install.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"   # the daemons live in sbin, not always on PATH

# Already there: nothing to do.
missing=0
for cmd in munged slurmctld slurmd sbatch scontrol squeue; do
  command -v "$cmd" >/dev/null || missing=1
done
if [ "$missing" = 0 ]; then
  echo "SLURM and munge are installed ($(slurmctld -V))"
  exit 0
fi

# Only root with apt-get can install.
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "cannot install SLURM here: needs root and apt-get" >&2
  exit 1
fi

# The packages, without recommends (no plugin -dev packages); no daemon is started.
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
echo "installed $(slurmctld -V)"
