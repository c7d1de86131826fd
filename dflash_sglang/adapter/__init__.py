"""The SGLang adapter: the only code in dflash_sglang that imports sglang.

Importing this package checks the installed SGLang version first (versions.py: 0.5.17 .. 0.5.23), so an unsupported
SGLang fails at plugin import with one clear line (SGLang logs it and keeps its builtin DFLASH) instead of failing
later inside the scheduler.

The rooms, by when they run (each folder's `__init__` says what it holds; docs/structure.md has a line per module):
- `boot/`: start-up and admission, before anything is served: the plugin's entry point and hooks, our flags, the
  resolution of SGLang's flags and ours into `DFlashSettings`, every start-up refusal, per-request refusals;
- `step/`: every decode step, in each scheduler process: the worker SGLang drives and what a step calls (verify,
  trees, logprobs, penalties, hidden states, hybrid targets, the per-step shape, metrics);
- `draft/`: the drafter over the paged draft KV pool (weights, pool, attention, CUDA graphs, context rows, memory);
- `scale/`: scale-out (tensor parallelism, DP attention, PD disaggregation, HiCache), called by the step;
- `settings.py` (what start-up resolved and every step reads), `simulate.py` (simulated acceptance and step cost for
  capacity planning: read at start-up, applied by the step) and `versions.py` (the one seam for what differs between
  SGLang releases), read by every room.
Imports run downward only: boot -> step -> scale -> draft; every room may read settings, simulate and versions.
"""
from __future__ import annotations

from .versions import SUPPORTED, UnsupportedSGLangError, require_supported_sglang  # noqa: F401  (checks the version)

# Our worker honours SGLANG_SIMULATE_ACC_* (simulate.py) in chain mode; bench_pareto checks this flag
# before trusting the `ours` arm of a simulated-acceptance run (docs/benchmarks.md, Serving benchmarks).
SIMULATED_ACCEPTANCE = True
