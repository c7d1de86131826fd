"""SGLang plugin entry point: `--speculative-algorithm DFLASH` runs dflash_sglang's worker.

Declared in pyproject as `[project.entry-points."sglang.srt.plugins"] dflash_sglang = ...:register`.
SGLang 0.5.17 calls `load_plugins()` in every process that builds ServerArgs or a worker (Engine,
launch_server, the `sglang serve` CLI, and first thing in each scheduler process), then applies the
hooks registered here. We keep SGLang's builtin `SpeculativeAlgorithm.DFLASH` enum member, so every
decision SGLang keys on it (target feature capture at the draft's layer ids, draft-KV memory budget,
`prepare_for_decode` over-allocation, request validation, metrics) stays as it is, and wrap these with
AROUND hooks:

- `SpeculativeAlgorithm.create_worker`: DFLASH -> `dflash_sglang.adapter.worker.DFlashWorker`.
- `speculative_hook._handle_dflash`: DFLASH server-arg resolution (the builtin one refuses CPU), plus a
  precheck around `speculative_hook.handle_speculative_decoding` so unsupported flags and unreadable draft
  checkpoints fail with one line before SGLang's generic handling touches the draft path.
- `dflash_utils.validate_dflash_request`: also refuse grammar-constrained requests (not supported yet),
  so they are aborted with a message instead of decoding unconstrained.
- `dflash_utils.resolve_dflash_verify_mask_policy`: with `DFLASH_TREE_CUDA_GRAPH=1` and trees configured, the
  target's verify CUDA graphs are captured with the custom-mask buffers (adapter/verify.py).
- on CPU only, two helpers that the speculative path runs as Triton kernels (adapter/cpu.py): the KV-copy
  warm-up of the target pool and `assign_req_to_token_pool_func` (used by `prepare_for_decode`).

`DFLASH_SGLANG_IMPL=builtin` hands DFLASH back to SGLang's builtin (read when a hook runs, so it
applies per process; set it for the whole server).
"""
from __future__ import annotations

import os

from . import require_supported_sglang

IMPL_ENV = "DFLASH_SGLANG_IMPL"
IMPLS = ("ours", "builtin")

CREATE_WORKER = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
HANDLE_ARGS = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
HANDLE_SPEC = "sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding"
VALIDATE_REQUEST = "sglang.srt.speculative.dflash_utils.validate_dflash_request"
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
KV_COPY_WARMUP = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
ASSIGN_REQ_TO_TOKEN = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
MASK_POLICY = "sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy"


def impl() -> str:
    """Which DFLASH implementation serves: `ours` (default) or `builtin` (SGLang's own)."""
    value = os.environ.get(IMPL_ENV, "ours").strip().lower() or "ours"
    if value not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={value!r}: expected one of {', '.join(IMPLS)}")
    return value


def _create_worker(original, algo, server_args):
    if algo.is_dflash() and impl() == "ours":
        from .worker import DFlashWorker

        return DFlashWorker
    return original(algo, server_args)


def _handle_dflash(original, server_args):
    if impl() == "ours":
        from .args import handle_dflash_args

        return handle_dflash_args(server_args)
    return original(server_args)


def _handle_speculative_decoding(original, server_args):
    if str(server_args.speculative_algorithm or "").upper() == "DFLASH" and impl() == "ours":
        from .args import precheck

        precheck(server_args)
    return original(server_args)


def _verify_mask_policy(original, attn_backend):
    """(backend name, build_custom_mask) for the target's verify graph capture: with DFLASH_TREE_CUDA_GRAPH=1 and
    trees configured, capture with the mask buffers so tree verifies replay graphs (adapter/verify.py)."""
    name, build = original(attn_backend)
    if not build and impl() == "ours":
        from sglang.srt.server_args import get_global_server_args

        from .verify import masked_verify_graphs

        if masked_verify_graphs(get_global_server_args()):
            return name, True
    return name, build


def _validate_request(original, req, enable_overlap):
    error = original(req, enable_overlap)
    if error is None and impl() == "ours":
        used = [f for f in GRAMMAR_FIELDS if getattr(req.sampling_params, f, None)]
        if used:
            error = f"DFLASH (dflash-sglang) does not support grammar-constrained requests yet ({used[0]})"
    return error


_registered = False


def register() -> None:
    """Entry point (zero-argument, run for its side effects by SGLang's `load_plugins`).

    A bad DFLASH_SGLANG_IMPL value is reported by the hooks when they run (ServerArgs construction),
    not here: SGLang only logs exceptions raised by plugins and would silently keep the builtin.
    """
    global _registered
    require_supported_sglang()
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(CREATE_WORKER, _create_worker, HookType.AROUND)
    HookRegistry.register(HANDLE_SPEC, _handle_speculative_decoding, HookType.AROUND)
    HookRegistry.register(HANDLE_ARGS, _handle_dflash, HookType.AROUND)
    HookRegistry.register(VALIDATE_REQUEST, _validate_request, HookType.AROUND)
    HookRegistry.register(MASK_POLICY, _verify_mask_policy, HookType.AROUND)
    from .cpu import assign_req_to_token_pool_hook, kv_copy_warmup_hook

    HookRegistry.register(KV_COPY_WARMUP, kv_copy_warmup_hook, HookType.AROUND)
    HookRegistry.register(ASSIGN_REQ_TO_TOKEN, assign_req_to_token_pool_hook, HookType.AROUND)
    _registered = True
