"""What our DFLASH worker does not serve, refused at start-up with one line naming the flag (or variable) and why.

Runs once, in the process that builds ServerArgs, from the resolved read view (adapter/versions.py `view`): the
device, SGLang environment switches our worker cannot follow, multi-rank layouts (PP, context parallelism, DP attention
where it is not served), HiCache and PD disaggregation where this SGLang release has no path for our draft pool, and
the draft KV dtype. Every refusal is an `UnsupportedFlagError` (adapter/settings.py) that names `DFLASH_SGLANG_IMPL=
builtin` as the way to SGLang's own worker.
"""
from __future__ import annotations

import importlib.util
import os

from dflash_sglang.ops import find_nvcc

from ..settings import IMPL_ENV, UnsupportedFlagError
from ..versions import (
    SGLANG_VERSION,
    attention_dp,
    attention_dp_served,
    draft_kv_cache_dtype,
    hicache_draft_served,
    pd_disaggregation_supported,
)

DEVICES = ("cuda", "cpu")


def refuse(flag: str, value, why: str) -> None:
    shown = f"{flag} {value}" if value != "" else flag
    raise UnsupportedFlagError(f"{shown}: {why} (dflash-sglang DFLASH; set {IMPL_ENV}=builtin for SGLang's own)")


# SGLang environment switches our worker cannot follow: name -> why (refused when truthy, at start-up).
UNSUPPORTED_ENV = {
    # (0.5.20+: the scheduler grows the target KV pool after graph capture and asks the spec worker for its draft
    # runners to grow theirs; ours is sized with the target's pool at start-up and has no SGLang runner to grow)
    "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "the target KV pool resized after CUDA-graph capture would outgrow our "
                                            "draft KV pool, which is sized with it at start-up",
}


def check_supported_env(env=None) -> None:
    """One line for an SGLang environment switch our worker does not serve."""
    env = os.environ if env is None else env
    for name, why in UNSUPPORTED_ENV.items():
        if env.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            raise UnsupportedFlagError(f"{name}={env[name]}: {why} (dflash-sglang DFLASH; unset it, or set "
                                       f"{IMPL_ENV}=builtin for SGLang's own)")


def check_supported_flags(cfg, experimental: bool = False) -> None:
    """One line per flag our worker does not serve. cfg: a read view of the server args; experimental: our
    --speculative-dflash-experimental."""
    device = str(cfg.device)
    if device.split(":")[0] not in DEVICES:
        refuse("--device", device, f"only {' and '.join(DEVICES)} are supported")
    check_parallel_layout(cfg, bool(experimental))
    refusals = (
        # (SGLang 0.5.23's StreamingLLM sink beside a draft window: its builtin DFLASH does not keep one either)
        ("--speculative-draft-sink-size", "speculative_draft_sink_size", (None, 0),
         "the draft window keeps no sink rows (dflash-sglang reads the last W context positions only)"),
        ("--speculative-adaptive-config", "speculative_adaptive_config", (None, ""),
         "EAGLE's adaptive tuning file; DFLASH's adaptive shapes are --speculative-dflash-adaptive-table"),
        ("--speculative-use-block-verification", "speculative_use_block_verification", (None, False),
         "block verification is not supported (sampled drafts are verified by lossless rejection sampling)"),
        # (an external KV linker would move the target's KV without the draft's: lossless, but tau would collapse)
        ("--enable-unified-cache-external-linker", "enable_unified_cache_external_linker", (None, False),
         "the draft KV pool is not registered with the external KV linker"),
        # sampling_seed is read only in this mode; our rejection sampling draws its own randomness, and the verify is
        # not batch-invariant, so a seeded request would not give the same answer twice.
        ("--enable-deterministic-inference", "enable_deterministic_inference", (None, False),
         "seeded (sampling_seed), batch-invariant decoding is not served yet"),
    )
    for flag, name, ok, why in refusals:
        value = getattr(cfg, name, None)
        if value not in ok:
            refuse(flag, "" if value is True else value, why)
    if getattr(cfg, "enable_hierarchical_cache", False):
        check_hicache(bool(experimental))
    pd = disaggregation(cfg)
    if pd is not None and not pd_disaggregation_supported():
        refuse("--disaggregation-mode", pd, f"SGLang {SGLANG_VERSION} has no DFLASH path for PD disaggregation "
                "(0.5.20 and later have: prefill and decode servers transfer the draft KV pool)")
    draft_kv_dtype(cfg)
    if cfg.speculative_draft_model_path is None:
        raise UnsupportedFlagError("--speculative-algorithm DFLASH needs --speculative-draft-model-path DIR")
    if device.startswith("cuda"):
        if importlib.util.find_spec("flashinfer") is None:
            raise ImportError("--device cuda: DFLASH needs the GPU-only package flashinfer "
                              "(pip install flashinfer-python)")
        try:
            find_nvcc()  # our kernels are built at worker start-up (cached); a missing compiler fails here, not mid-run
        except RuntimeError as e:
            raise UnsupportedFlagError(f"--device cuda: {e}") from None


def check_hicache(experimental: bool) -> None:
    """--enable-hierarchical-cache: served where SGLang's HiCache takes our draft pool (adapter/hicache.py), behind
    --speculative-dflash-experimental until a GPU has run SGLang's transfer kernels over it."""
    flag = "--enable-hierarchical-cache"
    if not hicache_draft_served():
        refuse(flag, "", f"SGLang {SGLANG_VERSION} gives a DFLASH draft KV pool no HiCache host pool built from "
                "its buffers (0.5.23 has: the draft pool offloaded and loaded back with the target's)")
    if not experimental:
        refuse(flag, "", f"HiCache is not yet validated end to end on a GPU with dflash-sglang: pass {EXPERIMENTAL} "
                f"to serve it with ours, or set {IMPL_ENV}=builtin")

# Layouts with more than one rank of something that our worker does not serve yet: (flag, field, why). Read from the
# resolved view (SGLang's parallel hooks run before its speculative handling, where our precheck runs). Served:
# tensor and expert parallelism (experts are the target's own layers; our collectives, the draft vocab merge and
# rank-0 broadcasts, run on the TP group, which EP leaves as it is) and data-parallel replicas (`--dp-size N`: SGLang's
# DataParallelController starts one scheduler group per replica, each with these settings and its own worker and
# controller; nothing is shared between replicas). DWDP SGLang refuses itself with any draft worker.
PARALLEL_REFUSALS = (
    ("--pp-size", "pp_size", "pipeline parallelism is not supported yet (only 1)"),
    ("--attn-cp-size", "attn_cp_size", "context-parallel attention is not supported (the drafter reads every "
     "context position's draft K/V on each rank)"),
    ("--dcp-size", "dcp_size", "decode context parallelism is not supported (the drafter reads every context "
     "position's draft K/V on each rank)"),
)


def check_parallel_layout(cfg, experimental: bool = False) -> None:
    """Refuse every multi-rank layout our worker does not serve: PP, attention / decode / prefill context parallelism,
    and DP attention (either spelling) unless `experimental` on a release that serves it (adapter/dp_attention.py)
    with the lm_head split per attention-DP group. cfg: the resolved read view."""
    dp_attention = attention_dp(cfg)
    if dp_attention is not None:  # (on 0.5.17 its group count is --dp-size, which alone means replicas)
        flag, groups = dp_attention
        if not attention_dp_served():
            refuse(flag, groups, f"DP attention is not served by dflash-sglang on SGLang {SGLANG_VERSION} (0.5.23 "
                    "has what our step needs: per-step row counts for every attention-DP group)")
        if not experimental:
            refuse(flag, groups, f"DP attention is not yet validated end to end on a GPU with dflash-sglang: pass "
                    f"{EXPERIMENTAL} to serve it with ours, or set {IMPL_ENV}=builtin")
        if not getattr(cfg, "enable_dp_lm_head", False):
            refuse(flag, groups, "DFLASH under DP attention needs --enable-dp-lm-head: the drafter borrows the "
                    "target's lm_head, which must be split within each attention-DP group (its draft vocab merge "
                    "runs there, never across groups)")
        if os.environ.get("SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION", "").strip().lower() in ("1", "true"):
            refuse(flag, groups, "SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION=1: our step writes each "
                    "attention-DP group's rows itself (unset it)")
    for flag, name, why in PARALLEL_REFUSALS:
        value = int(getattr(cfg, name, 1) or 1)
        if value != 1:
            refuse(flag, value, why)
    if getattr(cfg, "enable_prefill_cp", False):
        refuse("--enable-prefill-cp", "", "prefill context parallelism is not supported (each rank would capture "
                "target features for part of the prompt only)")

# Draft KV dtypes (SGLang's names) our pool stores: the model dtype, bf16, or fp8 with unit scales
# (core/draft/draft_kv.py)
DRAFT_KV_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")


def draft_kv_dtype(cfg) -> str:
    """The draft KV pool's dtype name (adapter/versions.py `draft_kv_cache_dtype`: the draft flag, else
    --kv-cache-dtype), one of DRAFT_KV_DTYPES; "auto" = the model dtype."""
    flag, value = draft_kv_cache_dtype(cfg)
    if value not in DRAFT_KV_DTYPES:
        refuse(flag, value, f"the draft KV pool stores {', '.join(DRAFT_KV_DTYPES)} (block-scaled or fp4 KV not yet)")
    return value

EXPERIMENTAL = "--speculative-dflash-experimental"


def disaggregation(cfg) -> str | None:
    """The PD side this server runs ("prefill" / "decode"), None for a whole server."""
    mode = getattr(cfg, "disaggregation_mode", None)
    return None if mode in (None, "null") else str(mode)
