#!/usr/bin/env bash
# Installs SLURM (slurmctld, slurmd, their clients) and munge from Debian's packages, when not installed already.
# tests/test_slurm.py calls it: CI machines are fresh Debian-like containers where it runs as root with apt.
# Prints the seconds the install took (0 when nothing was installed), for the test's log.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null; then
    echo "slurm already installed: 0 s"
    exit 0
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "ci_slurm_setup.sh: installing slurm-wlm needs root and apt-get" >&2
    exit 3
fi
began=$SECONDS
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
# The packages' own start-up (systemd units) does not run in a container; the test starts the daemons itself.
apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
echo "installed slurm-wlm and munge in $((SECONDS - began)) s"
