#!/usr/bin/env python3
"""Soak / stress test: a DFLASH CPU SGLang server vs a plain one under a mixed hostile workload.

    python scripts/stress.py --mode chain,tree,adaptive --requests 300 --concurrency 64,256 --aborts 30

See `dflash_sglang/bench/soak/run.py` (what is measured) and docs/benchmarks.md. Prints a table (requests, aborted,
mismatches, errors, hangs, leaked slots, deaths) and, last, a JSON line; exits 1 on any failure.
"""
from dflash_sglang.bench.soak.run import main

if __name__ == "__main__":
    raise SystemExit(main())
