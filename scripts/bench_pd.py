#!/usr/bin/env python3
"""PD disaggregation vs one server on CPU: DFLASH tokens/s and acceptance across a prefill -> decode transfer.

    python scripts/bench_pd.py --arms whole,pd,plain,plain-pd --requests 32 --concurrency 8 --repeats 3

See `dflash_sglang/bench/serving/pd.py` and docs/benchmarks.md. Exits 1 when a greedy answer differs from the first
arm's.
"""
from dflash_sglang.bench.serving.pd import main

if __name__ == "__main__":
    raise SystemExit(main())
