"""The SGLang adapter: the only code in dflash_sglang that imports sglang.

Importing this package checks the installed SGLang version first, so an unsupported SGLang fails at
plugin import with one clear line (SGLang logs it and keeps its builtin DFLASH) instead of failing
later inside the scheduler. Modules: plugin (entry point + hooks), args (server-arg handling for
DFLASH), model (the drafter over a paged draft KV pool), draft_attention (its paged attention:
FlashInfer on CUDA, torch on CPU), verify (target verify forward + acceptance),
tree / tree_attention (tree verification: the step's tree pieces, the tree mask), adaptive (per-step shapes
by batch size, DFLASH_ADAPTIVE=1), worker (the spec-v2 worker the scheduler drives), cpu (torch stand-ins for
Triton-only helpers).
See docs/sglang.md.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED_SGLANG = "0.5.17"


class UnsupportedSGLangError(ImportError):
    """The installed SGLang is not the version this adapter was written against."""


def require_supported_sglang() -> str:
    try:
        found = version("sglang")
    except PackageNotFoundError:
        raise UnsupportedSGLangError(
            f"dflash_sglang.adapter needs sglang=={SUPPORTED_SGLANG}, but sglang is not installed "
            f"(pip install 'dflash-sglang[sglang]')"
        ) from None
    if found != SUPPORTED_SGLANG:
        raise UnsupportedSGLangError(
            f"dflash_sglang.adapter supports sglang=={SUPPORTED_SGLANG} only, found sglang=={found}: "
            f"install sglang=={SUPPORTED_SGLANG}, or uninstall dflash-sglang to use SGLang's builtin DFLASH"
        )
    return found


require_supported_sglang()

# Our worker honours SGLANG_SIMULATE_ACC_* (adapter/simulate.py) in chain mode; bench_pareto checks this flag
# before trusting the `ours` arm of a simulated-acceptance run (docs/benchmarks.md, Serving benchmarks).
SIMULATED_ACCEPTANCE = True
