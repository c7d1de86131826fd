"""The SGLang adapter: the only code in dflash_sglang that imports sglang.

Importing this package checks the installed SGLang version first (adapter/versions.py: 0.5.17 .. 0.5.23), so an
unsupported SGLang fails at plugin import with one clear line (SGLang logs it and keeps its builtin DFLASH)
instead of failing later inside the scheduler. Modules: versions (the version seam: everything that differs between
supported SGLang releases), settings (every setting, its flag and default; the resolved `DFlashSettings`), plugin
(entry point + hooks), args (server-arg resolution for DFLASH), requests (per-request refusals), model (the drafter
over a paged draft KV pool), draft_attention (its paged attention: FlashInfer on CUDA, torch on CPU), draft_graphs
(the draft pass and commit as CUDA graphs), verify (target verify forward + acceptance), tree / tree_attention (tree
verification: the step's tree pieces, the tree mask), adaptive (per-step shapes by batch size), simulate (forced
acceptance for capacity planning), worker (the spec-v2 worker the scheduler drives), cpu (torch stand-ins for
Triton-only helpers). See docs/sglang.md.
"""
from __future__ import annotations

from .versions import SUPPORTED, UnsupportedSGLangError, require_supported_sglang  # noqa: F401  (checks the version)

# Our worker honours SGLANG_SIMULATE_ACC_* (adapter/simulate.py) in chain mode; bench_pareto checks this flag
# before trusting the `ours` arm of a simulated-acceptance run (docs/benchmarks.md, Serving benchmarks).
SIMULATED_ACCEPTANCE = True
