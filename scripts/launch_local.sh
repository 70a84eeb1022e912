#!/usr/bin/env bash
# One machine, one JAX process per GPU: the multi-host layout of scripts/slurm_train.sh on a single host.
#
#   bash scripts/launch_local.sh 2 --config configs/llama1b_h100.yaml mesh.fsdp=-1 train.global_batch=16
#
# The first argument is the number of processes (default: every GPU nvidia-smi lists); the rest go to
# `python -m meshtrain.run` in every process. Process i drives GPU i (distributed.local_device_ids=i) and
# they meet through jax.distributed on the loopback (JAX_COORDINATOR_ADDRESS, any free port: PORT).
# Only process 0 prints progress and writes metrics; the others' output goes to <LOG_DIR>/process_<i>.log.
# When one process fails, the others are stopped instead of waiting in a collective for ever.
# PYTHON names the interpreter that has meshtrain (default: python).
set -uo pipefail
N=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
shift || true
if [[ "$N" == 0 ]]; then
    echo "launch_local.sh: no GPU found (nvidia-smi lists none): give the number of processes first; on CPUs each" \
         "process simulates run.cpu_devices devices, e.g. bash scripts/launch_local.sh 2 run.cpu_devices=4" >&2
    exit 2
fi
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch_local.sh: the first argument is the number of processes (one per GPU), got '$N'" >&2
    exit 2
fi
PORT=${PORT:-8476}
PYTHON=${PYTHON:-python}
LOG_DIR=${LOG_DIR:-/tmp/meshtrain_launch}
mkdir -p "$LOG_DIR"
export JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT JAX_NUM_PROCESSES=$N

# On CPUs the processes exchange data through gloo, whose C++ side prints "[Gloo] Rank r is connected to
# n peer ranks..." on stdout for every new group, from several threads at once (so lines interleave
# mid-word). The filter drops those messages, and the bare digits their interleaving leaves behind.
quiet_gloo() {
    if ((GPUS > 0)); then cat; return; fi
    # Each fragment goes separately: another thread's line break may split the message anywhere between them.
    sed -u -E -e 's/\[Gloo\] Rank ?| ?is connected to ?|Expected number of connected peer ranks is : ?| ?peer ranks\. ?//g' \
        -e 't gone' -e '/^[0-9]+$/d' -e b -e ':gone' -e '/^[0-9 ]*$/d'
}

pids=()
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
for ((i = 0; i < N; i++)); do
    dev=()  # on CPUs every process simulates its own run.cpu_devices devices
    ((GPUS > 0)) && dev=(distributed.local_device_ids=$i)
    if ((i == 0)); then
        JAX_PROCESS_ID=$i "$PYTHON" -m meshtrain.run "$@" "${dev[@]}" > >(quiet_gloo) &
    else
        JAX_PROCESS_ID=$i "$PYTHON" -m meshtrain.run "$@" "${dev[@]}" run.progress=false \
            > >(quiet_gloo > "$LOG_DIR/process_$i.log") 2>&1 &
    fi
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' INT TERM

status=0
for ((left = N; left > 0; left--)); do
    wait -n -p done_pid
    rc=$?
    if ((rc != 0)); then
        for ((i = 0; i < N; i++)); do [[ "${pids[i]}" == "$done_pid" ]] && break; done
        echo "launch_local.sh: process $i exited with $rc; stopping the others (logs: $LOG_DIR)" >&2
        # Process 0 prints to this terminal; another one's reason is in its log, which the reader
        # should not have to open: the others are stopped before they could print the same reason.
        if ((i > 0)); then tail -n 20 "$LOG_DIR/process_$i.log" | sed "s/^/[process $i] /" >&2; fi
        kill "${pids[@]}" 2>/dev/null
        status=$rc
        break
    fi
done
wait
exit $status
