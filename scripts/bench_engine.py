#!/usr/bin/env python3
"""CPU `sgl.Engine` decoding throughput per speculation arm (plain, DFLASH chain / static / floor / adaptive tables)
on the SmolLM2 testbed pair, one Engine at a time, outputs checked identical to plain.

    python scripts/bench_engine.py --arms plain,default,chain16,static,floor --concurrency 1,4,16,64 --new-tokens 64
    python scripts/bench_engine.py --arms plain,static,adaptive --workload switch --concurrency 4 --phase-rounds 3

`--repeats R` (3) interleaves: each repeat is a pass over the arms in turn, a fresh Engine per arm, and each ratio to
plain is the median of the repeats' with a 95% interval, called a speedup or slower only when the interval excludes
1.0 ("same as plain within noise" otherwise; one repeat: no interval, no verdict). `--resident`: each arm's Engine
started once and kept for every pass (many cheap passes, seconds apart: tighter intervals); `--baseline ARM`: ratios
against another arm than plain. See `dflash_sglang/bench/engine/compare.py`
(what is measured and why). Writes CSV + JSON (+ PNG for `switch`) and a log per arm and pass to --out; last stdout
line: JSON. Exit 1 on any output differing from plain or a failed arm.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_sglang.bench.engine.compare import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
