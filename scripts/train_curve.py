#!/usr/bin/env python3
"""Held-out tau estimate vs training CPU-hours of a `dflash-sglang train` run, from its train_log.jsonl.

    python scripts/train_curve.py work_tmp/cpu_run            # a table; the last stdout line is JSON

Each step record's `cpu_s` counts the process CPU seconds since that launch (a resumed run starts again from 0),
so the CPU spent up to a record is the sum over the earlier launches' last `cpu_s` plus this launch's; held-out
(`{"step", "val"}`) records take the CPU of the step record before them. Steps redone after a kill (between two
checkpoints) count twice: they were spent. Data preparation is not in the log (train_summary.json has
`data_time_s`, wall seconds of the last launch).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curve(records: list[dict]) -> list[dict]:
    """Held-out points [{step, cpu_h, tau_est, loss, acc1}] in log order."""
    done, last, points = 0.0, 0.0, []
    for r in records:
        if "loss" in r and "cpu_s" in r:
            if r["cpu_s"] < last:  # a new launch: its clock restarted
                done += last
            last = r["cpu_s"]
        elif "val" in r:
            v = r["val"]
            points.append({"step": r["step"], "cpu_h": round((done + last) / 3600, 3), "tau_est": v["tau_est"],
                           "loss": v["loss"], "acc1": v["acc"][1]})
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the training output directory (holds train_log.jsonl)")
    args = ap.parse_args(argv)
    path = args.run / "train_log.jsonl"
    if not path.is_file():
        print(f"{path}: missing (not a training output directory?)", file=sys.stderr)
        return 2
    points = curve([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    print(f"{'step':>6} {'CPU-h':>7} {'tau_est':>8} {'loss':>7} {'top-1@1':>8}")
    for p in points:
        print(f"{p['step']:>6} {p['cpu_h']:>7.2f} {p['tau_est']:>8.3f} {p['loss']:>7.3f} {p['acc1']:>8.3f}")
    print(json.dumps({"script": "train_curve", "run": str(args.run), "points": points}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
