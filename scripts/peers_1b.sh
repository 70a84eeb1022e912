#!/usr/bin/env bash
# meshtrain's 1B loop beside the peers, back to back on one GPU (docs/PERFORMANCE.md quotes its output).
#
#   PEERS=path/to/peers OUT_DIR=results bash scripts/peers_1b.sh [meshtrain key=value ...]
#
# PEERS holds the peers of ../shared/peers (maxtext/, torch_llama.py, jax_plain_llama.py); on the device
# machine copy them into the checkout first. Runs, each in its own process with a time limit:
#   1. MaxText's run.sh recipe (the peer to beat)
#   2. python -m meshtrain.run --config configs/llama1b_h100.yaml, 60 steps, the given overrides
#   3. the PyTorch (torch.compile) peer
#   4. MaxText again when REPEAT=1, so drift within the call shows
# and prints one summary line per run last. Full logs go to OUT_DIR.
set -uo pipefail
PEERS="${PEERS:-../shared/peers}"
OUT_DIR="${OUT_DIR:-results/peers_1b}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

maxtext() {  # $1: label
  # run.sh prints its MAXTEXT_PEER summary line on stdout, after the log it writes to MT_LOG.
  MT_LOG="$OUT_DIR/maxtext_$1.log" timeout 420 bash "$PEERS/maxtext/run.sh" > "$OUT_DIR/maxtext_$1.out" 2>&1
  grep -h "MAXTEXT_PEER:" "$OUT_DIR/maxtext_$1.out" | tail -1 | sed "s/^/[$1] /" >> "$OUT_DIR/summary.txt" \
    || echo "[$1] MAXTEXT_PEER: no result (see $OUT_DIR/maxtext_$1.log)" >> "$OUT_DIR/summary.txt"
}

meshtrain() {  # $1: label, then overrides
  local label=$1; shift
  timeout 300 "$PY" -m meshtrain.run --config configs/llama1b_h100.yaml train.steps=60 train.log_every=10 \
    run.progress=false run.dir="/tmp/meshtrain_$label" "$@" > "$OUT_DIR/meshtrain_$label.log" 2>&1
  # Steady state: the median of the logged intervals after step 20 (each the mean of 10 steps), by
  # scripts/compare_runs.py's rule.
  "$PY" - "/tmp/meshtrain_$label" "$label" >> "$OUT_DIR/summary.txt" <<'PYEOF'
import os, sys
sys.path.insert(0, "scripts")  # run from the repository root
from compare_runs import summarize
run_dir, label = sys.argv[1], sys.argv[2]
if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
    print(f"[{label}] MESHTRAIN: no metrics ({run_dir}/metrics.jsonl)"); sys.exit()
s = summarize(run_dir, after=20)
if s["step_ms"] is None:
    print(f"[{label}] MESHTRAIN: no steady-state records"); sys.exit()
t, times = s["step_ms"], s["step_ms_all"]
print(f"[{label}] MESHTRAIN: median step {t:.1f} ms over {len(times)} intervals of 10 steps "
      f"(min {min(times):.1f}, max {max(times):.1f}), {16384 / t:.1f}k tok/s, MFU {s['mfu'] * 100:.1f}%, "
      f"peak {s['peak_mem_gib']:.1f} GiB, final loss {s['final_loss']:.4f}")
PYEOF
}

torch_peer() {
  timeout 300 "$PY" "$PEERS/torch_llama.py" > "$OUT_DIR/torch.log" 2>&1
  tail -1 "$OUT_DIR/torch.log" | sed 's/^/[torch] /' >> "$OUT_DIR/summary.txt"
}

: > "$OUT_DIR/summary.txt"
maxtext first
meshtrain default "$@"
torch_peer
[ "${REPEAT:-0}" = 1 ] && maxtext last
cat "$OUT_DIR/summary.txt"
