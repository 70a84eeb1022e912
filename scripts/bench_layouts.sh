#!/usr/bin/env bash
# Per-GPU throughput of the parallel layouts on one multi-GPU machine, each against one GPU in the same
# call (docs/PERFORMANCE.md, "Two H100s"). Every run is scripts/bench_step.py (median of synchronized steps).
#
#   OUT_DIR=results bash scripts/bench_layouts.sh [8b|1b|tiny] [extra key=value ...]
#
# 8b: Llama-3-8B cut to LAYERS layers (default 8), seq 4096, PER_GPU sequences per GPU (default 2), save_dots,
#     lr 3e-4 (the default 3e-3 is the tiny model's; at this width it makes the loss jump within the
#     timed steps, which changes no timing but reads as a divergence).
# 1b: configs/llama1b_h100.yaml, 8 sequences per GPU.
# tiny: the tiny model, to try the script itself (on CPUs: XLA_FLAGS=--xla_force_host_platform_device_count=2
# JAX_PLATFORMS=cpu N_GPUS=2; there "one GPU" is every CPU device).
# Layouts over all N visible GPUs: fsdp=N (ZeRO-3); tp=N with sequence parallelism, plain and with each
# parallel.tp_overlap; and, for N >= 4, fsdp=N/2 x tp=2 with SP. Results: $OUT_DIR/layouts.jsonl, and a
# table on stdout with per-GPU throughput against one GPU and against the fsdp layout. LAYOUTS="fsdp tp" (names
# below) runs a subset.
set -uo pipefail
SHAPE=${1:-8b}
shift || true
OUT_DIR=${OUT_DIR:-results/layouts}
PY=${PYTHON:-python3}
N=${N_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
case "$SHAPE" in
    8b) PER_GPU=${PER_GPU:-2}; BASE=(model.preset=llama3_8b "model.n_layers=${LAYERS:-8}" data.seq_len=4096 train.remat=save_dots train.lr=3e-4) ;;
    1b) PER_GPU=8; BASE=(--config configs/llama1b_h100.yaml) ;;
    tiny) PER_GPU=2; BASE=(model.preset=tiny data.seq_len=64 model.attention=reference) ;;
    *) echo "bench_layouts.sh: shape must be 8b, 1b or tiny, got '$SHAPE'" >&2; exit 2 ;;
esac
if ((N < 2)); then
    echo "bench_layouts.sh: needs at least 2 GPUs, found $N" >&2
    exit 2
fi
BATCH=$((PER_GPU * N))
SP=(mesh.fsdp=1 "mesh.tp=$N" parallel.sequence_parallel=true)
declare -A RUN=(
    [fsdp]="mesh.fsdp=-1 train.zero_stage=3"
    [tp]="${SP[*]}"
    [tp_ring]="${SP[*]} parallel.tp_overlap=collective_matmul"
    [tp_windowed]="${SP[*]} parallel.tp_overlap=windowed_einsum"
    [fsdp_tp2]="mesh.fsdp=-1 mesh.tp=2 parallel.sequence_parallel=true train.zero_stage=3"
)
ORDER=(fsdp tp tp_ring tp_windowed)
((N >= 4)) && ORDER+=(fsdp_tp2)
LAYOUTS=(${LAYOUTS:-${ORDER[*]}})

bench() {  # label, then overrides
    local label=$1; shift
    timeout 600 "$PY" scripts/bench_step.py "${BASE[@]}" --label "$label" --out "$OUT_DIR/layouts.jsonl" "$@" \
        > "$OUT_DIR/$label.log" 2>&1 || echo "bench_layouts.sh: $label failed (see $OUT_DIR/$label.log)" >&2
    grep "^meshtrain" "$OUT_DIR/$label.log"
}

CUDA_VISIBLE_DEVICES=0 bench one_gpu "train.global_batch=$PER_GPU" "$@"
for name in "${LAYOUTS[@]}"; do
    # shellcheck disable=SC2086  # the layout's overrides are separate words
    bench "$name" "train.global_batch=$BATCH" ${RUN[$name]} "$@"
done

"$PY" - "$OUT_DIR/layouts.jsonl" "$N" <<'PYEOF'
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
runs = {}
for line in open(path):
    r = json.loads(line)
    runs[r["label"]] = r  # the newest record of each label
one, fsdp = runs.get("one_gpu"), runs.get("fsdp")
print(f"\n{'layout':<14} {'ms/step':>9} {'tokens/s':>10} {'MFU/GPU':>8} {'per GPU vs one GPU':>19} {'vs fsdp':>8}")
for label, r in runs.items():
    per_gpu = r["tokens_per_s"] / (1 if label == "one_gpu" else n)
    vs = f"{per_gpu / one['tokens_per_s']:.3f}" if one and label != "one_gpu" else ""
    vs_fsdp = f"{r['tokens_per_s'] / fsdp['tokens_per_s']:.3f}" if fsdp and label != "one_gpu" else ""
    mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
    print(f"{label:<14} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} {mfu:>8} {vs:>19} {vs_fsdp:>8}")
PYEOF
