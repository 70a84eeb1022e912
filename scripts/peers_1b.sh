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
  # Steady state: the median of the logged intervals after step 20 (each the mean of 10 steps).
  "$PY" - "/tmp/meshtrain_$label/metrics.jsonl" "$label" >> "$OUT_DIR/summary.txt" <<'PYEOF'
import json, statistics, sys
path, label = sys.argv[1], sys.argv[2]
try:
    recs = [json.loads(l) for l in open(path) if l.strip()]
except OSError:
    print(f"[{label}] MESHTRAIN: no metrics ({path})"); sys.exit()
recs = [r for r in recs if "step_time_s" in r and r["step"] > 20 and not r.get("includes_compile")]
if not recs:
    print(f"[{label}] MESHTRAIN: no steady-state records"); sys.exit()
t = statistics.median(r["step_time_s"] for r in recs)
print(f"[{label}] MESHTRAIN: median step {t * 1e3:.1f} ms over {len(recs)} intervals of 10 steps "
      f"(min {min(r['step_time_s'] for r in recs) * 1e3:.1f}, max {max(r['step_time_s'] for r in recs) * 1e3:.1f}), "
      f"{16384 / t / 1e3:.1f}k tok/s, MFU {statistics.median(r['mfu'] for r in recs) * 100:.1f}%, "
      f"peak {recs[-1].get('peak_mem_gib', 0):.1f} GiB, final loss {recs[-1]['loss']:.4f}")
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
