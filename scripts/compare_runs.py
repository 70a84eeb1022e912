"""Put runs of `python -m meshtrain.run` side by side: the loss at every logged step, and the steady-state
step time (median of the logged intervals after --after steps, compile excluded). The first run is the
reference; each other run is compared against it.

  python scripts/compare_runs.py runs/one_process runs/two_processes [--after 20] [--rtol 0.01] [--out f.json]

Exits 1 when a loss differs from the reference's by more than --rtol (relative), or the runs logged
different steps; so a launch script can check equality in one line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def read_metrics(run_dir: str) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        sys.exit(f"compare_runs: no {path} (did the run finish? only process 0 writes metrics)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(run_dir: str, after: int) -> dict:
    recs = [r for r in read_metrics(run_dir) if "loss" in r and "step_time_s" in r]
    steady = [r for r in recs if r["step"] > after and not r.get("includes_compile")]
    times = [r["step_time_s"] for r in steady]
    mfus = [r["mfu"] for r in steady if r.get("mfu")]  # none on a CPU
    return dict(run=run_dir, losses={r["step"]: r["loss"] for r in recs},
                step_ms=statistics.median(times) * 1e3 if times else None,
                step_ms_all=[round(s * 1e3, 1) for s in times],
                mfu=statistics.median(mfus) if mfus else None,
                peak_mem_gib=steady[-1].get("peak_mem_gib", 0.0) if steady else None,
                final_loss=steady[-1]["loss"] if steady else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run.dir of each run; the first is the reference")
    ap.add_argument("--after", type=int, default=20, help="steady state: logged intervals ending after this step")
    ap.add_argument("--rtol", type=float, default=0.01, help="largest relative loss difference that counts as equal")
    ap.add_argument("--out", default="", help="also write the comparison as JSON here")
    a = ap.parse_args()
    if len(a.runs) < 2:
        ap.error("give at least two run directories")
    runs = [summarize(r, a.after) for r in a.runs]
    ref = runs[0]
    ok = True
    for r in runs:
        rel = [abs(r["losses"][s] - ref["losses"][s]) / abs(ref["losses"][s])
               for s in ref["losses"] if s in r["losses"]]
        r["max_rel_loss_diff"] = max(rel) if rel else None
        r["same_steps"] = sorted(r["losses"]) == sorted(ref["losses"])
        r["step_ratio"] = r["step_ms"] / ref["step_ms"] if r["step_ms"] and ref["step_ms"] else None
        ok &= bool(rel) and (r["max_rel_loss_diff"] or 0.0) <= a.rtol  # on the steps both logged
    steps = sorted(ref["losses"])
    print("step  " + "  ".join(f"{Path(r['run']).name:>16}" for r in runs))
    for s in steps:
        print(f"{s:4d}  " + "  ".join(f"{r['losses'].get(s, float('nan')):16.5f}" for r in runs))
    for r in runs:
        t = f"{r['step_ms']:.1f} ms/step (intervals {r['step_ms_all']})" if r["step_ms"] else "no steady-state interval"
        vs = "" if r is ref else (f"; {r['step_ratio']:.4f}x the reference's step time" if r["step_ratio"] else "") + \
            (f"; loss within {r['max_rel_loss_diff']:.2e} relative" if r["max_rel_loss_diff"] is not None else "")
        print(f"{r['run']}: {t}{vs}" + ("" if r["same_steps"] else "; LOGGED OTHER STEPS"))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(rtol=a.rtol, after=a.after, equal=ok, runs=runs), indent=1) + "\n")
    common = set.intersection(*(set(r["losses"]) for r in runs))
    where = "" if all(r["same_steps"] for r in runs) else f" on the {len(common)} steps every run logged"
    print(f"losses equal within rtol{where}" if ok else f"losses NOT equal within rtol {a.rtol}{where}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
