#!/bin/bash
# Multi-host GPU training under SLURM: one task (one JAX process) per node, each driving its node's GPUs.
#
#   sbatch scripts/slurm_train.sh                                   # 2 nodes x 8 GPUs, configs/llama1b_h100.yaml
#   sbatch --nodes=4 scripts/slurm_train.sh train.steps=2000 data.source=file data.path=/shared/tokens.bin \
#          data.dtype=uint16 model.vocab_size=257               # extra arguments: meshtrain overrides (last wins)
#   CONFIG=configs/other.yaml sbatch scripts/slurm_train.sh         # another config (CONFIG= : none, the defaults)
#
# On CPU nodes (a dry run of the launch; tests/test_slurm.py): no GPUs, two tasks on one node, each process
# simulating run.cpu_devices CPU devices. Command-line options win over the #SBATCH lines below:
#   GPUS_PER_NODE=0 CONFIG= sbatch --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 \
#       scripts/slurm_train.sh run.cpu_devices=4 mesh.dp=2 mesh.fsdp=2 mesh.tp=2 train.global_batch=16
#
# Run it from the repository root (sbatch keeps the submit directory), with the environment that has meshtrain
# and jax[cuda12] installed already active. run.dir (checkpoints, metrics) and data.path must be on a filesystem
# that every node sees: checkpoints are written by all processes together, and each process reads its own rows.
#
# Mesh: mesh.fsdp=-1 spreads FSDP over every GPU of every node. Only pp, dp and fsdp may cross nodes; tp stays
# inside one (NVLink). For hybrid sharding (FSDP inside a node, data parallel across nodes, less inter-node
# traffic) pass instead:  mesh.dp=$SLURM_NNODES mesh.fsdp=8
#
#SBATCH --job-name=meshtrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "submit this with sbatch (or run it inside an salloc allocation)" >&2
    exit 2
fi

CONFIG=${CONFIG-configs/llama1b_h100.yaml}  # set and empty: no config file
PORT=${JAX_COORDINATOR_PORT:-12355}     # any free TCP port on the first node
PYTHON=${PYTHON:-python}                # the interpreter that has meshtrain, on every node
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}  # 0: CPU devices
N_GPUS=$((SLURM_JOB_NUM_NODES * GPUS_PER_NODE))

# meshtrain.mesh.initialize_distributed reads these three. The coordinator is process 0's host: the first node
# of the allocation. (With none of them set, jax also detects a multi-task SLURM job by itself; setting them
# keeps the launch explicit and works under any launcher.)
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export JAX_COORDINATOR_ADDRESS="${head_node}:${PORT}"
export JAX_NUM_PROCESSES=$SLURM_NTASKS
# JAX_PROCESS_ID differs per task, so it is set inside srun below from SLURM_PROCID.

# Optional GPU settings:
# export XLA_PYTHON_CLIENT_MEM_FRACTION=0.90   # jax preallocates 75% of GPU memory by default (or run.gpu_memory_fraction)
# export NCCL_DEBUG=WARN                       # INFO to see which network NCCL picked between nodes

args=(${CONFIG:+--config "$CONFIG"} mesh.fsdp=-1 run.dir="runs/${SLURM_JOB_NAME}")
if ((GPUS_PER_NODE > 0)); then
    echo "meshtrain: ${SLURM_JOB_NUM_NODES} nodes x ${GPUS_PER_NODE} GPUs, coordinator ${JAX_COORDINATOR_ADDRESS}"
    # The llama1b config holds 8 sequences per GPU on one GPU; keep that per-GPU batch on every GPU.
    args+=(train.global_batch=$((8 * N_GPUS)))
else
    echo "meshtrain: ${SLURM_NTASKS} tasks on ${SLURM_JOB_NUM_NODES} node(s), CPU devices, coordinator" \
         "${JAX_COORDINATOR_ADDRESS}"
fi

# run.dir is named after the job, so a resubmitted job of the same name resumes from its last checkpoint
# (add e.g. checkpoint.every=200 to save some).
# --kill-on-bad-exit: one failing process ends the job instead of leaving the others waiting in a collective.
srun --kill-on-bad-exit=1 bash -c 'export JAX_PROCESS_ID=$SLURM_PROCID; exec "$0" -m meshtrain.run "$@"' \
    "$PYTHON" "${args[@]}" "$@"
