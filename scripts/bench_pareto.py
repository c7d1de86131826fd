#!/usr/bin/env python3
"""Serving Pareto sweep (tokens/s/GPU vs tokens/s/user) for DFLASH ours / builtin / no speculation.

    python scripts/bench_pareto.py --recipe qwen3-8b:h100 --concurrency 1,2,4,8,16,32 --num-prompts 256

See `dflash_sglang/bench/serving/pareto.py` (method) and docs/benchmarks.md, "Serving benchmarks". Last stdout line:
JSON.
"""
from dflash_sglang.bench.serving.pareto import main

if __name__ == "__main__":
    raise SystemExit(main())
