#!/usr/bin/env python3
"""CPU `sgl.Engine` decoding throughput per speculation arm (plain, DFLASH chain / static / floor / adaptive tables)
on the SmolLM2 testbed pair, one Engine at a time, outputs checked identical to plain.

    python scripts/bench_engine.py --arms plain,default,chain16,static,floor --concurrency 1,4,16,64 --new-tokens 64
    python scripts/bench_engine.py --arms plain,static,adaptive --workload switch --concurrency 4 --phase-rounds 3

See `dflash_sglang/bench/engine.py` (what is measured and why). Writes CSV + JSON (+ PNG for `switch`) and a log per
arm to --out; last stdout line: JSON. Exit 1 on any output differing from plain or a failed arm.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_sglang.bench.engine import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
