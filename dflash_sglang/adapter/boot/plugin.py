"""SGLang plugin entry point: `--speculative-algorithm DFLASH` runs dflash_sglang's worker.

Declared in pyproject as `[project.entry-points."sglang.srt.plugins"] dflash_sglang = ...:register`. SGLang
(0.5.17 and 0.5.23) calls `load_plugins()` in every process that builds ServerArgs or a worker (Engine,
launch_server, the `sglang serve` CLI, and first thing in each scheduler process), then applies the hooks
registered here. We keep SGLang's builtin `SpeculativeAlgorithm.DFLASH` enum member, so every decision SGLang
keys on it (target feature capture at the draft's layer ids, `prepare_for_decode` over-allocation, request
validation, metrics) stays as it is, and wrap these with AROUND hooks:

- `ServerArgs.add_cli_args` / `ServerArgs.from_cli_args`: our `--speculative-dflash-*` flags on SGLang's own parser
  (shown in `--help`, adapter/boot/flags.py); `Engine.server_args_class` (set directly, see `_engine_server_args`)
  takes them as `sgl.Engine(...)` keywords;
- `speculative_hook.handle_speculative_decoding`: our precheck first (unsupported flags, retired variables, the
  draft checkpoint), so errors are one line before SGLang's generic handling touches the draft path; our flags
  with another algorithm or the builtin are refused;
- `speculative_hook._handle_dflash`: our resolution into `DFlashSettings` (the builtin one refuses CPU);
- `SpeculativeAlgorithm.create_worker`: DFLASH -> `dflash_sglang.adapter.worker.DFlashWorker`;
- `TokenizerManager._validate_one_request` and `dflash_utils.validate_dflash_request`: also refuse what our worker
  cannot serve identically (adapter/boot/requests.py), first on the tokenizer side (before scheduling);
- `dflash_utils.scale_kv_cell_size_per_token_for_dflash`: SGLang's KV sizing counts our draft pool's exact bytes per
  token (adapter/draft/memory.py);
- PD disaggregation's decode side (0.5.20 on; adapter/scale/disagg.py): `DecodePreallocQueue._pre_alloc` marks a
  transfer's draft rows unsent, `build_dflash_disagg_draft_input` checks them when the requests join the decode batch;
  `Req.offload_kv_cache` / `Req.load_kv_cache` back up and restore a retracted request's draft rows with its target KV
  (`--disaggregation-decode-retraction-backup cpu_tensor`, adapter/scale/retraction.py);
- `dflash_utils.resolve_dflash_verify_mask_policy`: with `--speculative-dflash-tree-cuda-graph` and trees, the
  target's verify CUDA graphs are captured with the custom-mask buffers (adapter/step/verify.py);
- on CPU only, two helpers that the speculative path runs as Triton kernels (adapter/step/cpu.py): the KV-copy
  warm-up of the target pool and `assign_req_to_token_pool_func` (used by `prepare_for_decode`); and the grammar
  bitmask's allocation and application, which SGLang 0.5.17 cannot do on CPU (plain servers included).

`DFLASH_SGLANG_IMPL=builtin` hands DFLASH back to SGLang's builtin (read when a hook runs, so it applies per
process; set it for the whole server).
"""
from __future__ import annotations

import os
import sys

from ..settings import IMPL_ENV
from ..versions import require_supported_sglang, version_hooks
from .flags import add_plugin_flags, nondefault_plugin_flags, pending_flags, split_plugin_flags

IMPLS = ("ours", "builtin")

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
CREATE_WORKER = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
HANDLE_ARGS = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
HANDLE_SPEC = "sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding"
VALIDATE_REQUEST = "sglang.srt.speculative.dflash_utils.validate_dflash_request"
VALIDATE_INPUT = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
KV_COPY_WARMUP = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
ASSIGN_REQ_TO_TOKEN = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
MASK_POLICY = "sglang.srt.speculative.dflash_utils.resolve_dflash_verify_mask_policy"
ROW_HEADROOM = "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len"
GRAMMAR_BITMASK = "sglang.srt.constrained.xgrammar_backend._allocate_token_bitmask"
GRAMMAR_APPLY = "sglang.srt.constrained.xgrammar_backend.XGrammarGrammar.apply_vocab_mask"


def impl() -> str:
    """Which DFLASH implementation serves: `ours` (default) or `builtin` (SGLang's own)."""
    value = os.environ.get(IMPL_ENV, "ours").strip().lower() or "ours"
    if value not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={value!r}: expected one of {', '.join(IMPLS)}")
    return value


def _ours(server_args) -> bool:
    return str(server_args.speculative_algorithm or "").upper() == "DFLASH" and impl() == "ours"


def _add_cli_args(original, parser):
    original(parser)
    add_plugin_flags(parser)


def _with_our_flags(ours: dict, build):
    """build() -> ServerArgs with our flags pending while it is built (0.5.17 resolves inside the constructor), then
    attached to the record (0.5.23 resolves later, from the record; bookkeeping, not a field)."""
    with pending_flags(ours):
        server_args = build()
    setattr(server_args, "_dflash_flags", ours)
    return server_args


def _from_cli_args(original, cls, args):
    return _with_our_flags(split_plugin_flags(vars(args))[0], lambda: original(cls, args))


def _engine_server_args(**kwargs):
    """`Engine.server_args_class` while we are loaded: the Engine's keywords minus our flags -> ServerArgs, our flags
    attached. Set directly, not through HookRegistry: `Engine.__init__` loads the plugins and then builds its
    ServerArgs, so an __init__ hook would miss the first Engine, and a REPLACE hook on a class rebinds that class in
    every module."""
    from sglang.srt.server_args import ServerArgs

    ours, rest = split_plugin_flags(kwargs)
    return _with_our_flags(ours, lambda: ServerArgs(**rest))


def _patch_engine_kwargs() -> None:
    """Route `sgl.Engine(...)` keywords through `_engine_server_args` (the Engine module is loaded whenever an Engine
    is being built; processes that never build one are left alone)."""
    engine = sys.modules.get("sglang.srt.entrypoints.engine")
    if engine is None:
        return
    from sglang.srt.server_args import ServerArgs

    if engine.Engine.server_args_class is ServerArgs:  # an Engine subclass with its own class is left alone
        engine.Engine.server_args_class = staticmethod(_engine_server_args)


def _handle_speculative_decoding(original, server_args):
    if _ours(server_args):
        from .resolve import precheck

        precheck(server_args)
    else:
        given = nondefault_plugin_flags(server_args)
        if given:
            raise ValueError(f"{given[0]}: a dflash-sglang flag, which only --speculative-algorithm DFLASH served by "
                             f"dflash-sglang reads (here {server_args.speculative_algorithm}, {IMPL_ENV}={impl()})")
    return original(server_args)


def _handle_dflash(original, server_args):
    if impl() == "ours":
        from .resolve import handle_dflash_args

        handle_dflash_args(server_args)
        return None
    return original(server_args)


def _create_worker(original, algo, server_args):
    if algo.is_dflash() and impl() == "ours":
        from ..step.worker import DFlashWorker

        return DFlashWorker
    return original(algo, server_args)


def _verify_mask_policy(original, attn_backend):
    """(backend name, build_custom_mask) for the target's verify graph capture: with
    --speculative-dflash-tree-cuda-graph and trees, capture with the mask buffers (adapter/step/verify.py)."""
    name, build = original(attn_backend)
    if not build and impl() == "ours":
        from sglang.srt.runtime_context import get_context

        from ..step.verify import masked_verify_graphs

        settings = getattr(get_context().server_args, "_dflash_settings", None)
        if settings is not None and masked_verify_graphs(settings):
            return name, True
    return name, build


def _row_headroom(original, *args, **kwargs):
    """req_to_token columns past the context length. Each decode step SGLang reserves KV slots up to 2·N past a
    request's committed length (`prepare_for_decode`, the overlap scheduler's double buffer), but sizes the row's
    headroom for N (page size 1): near the context limit the reservation ran past the row, losing slots (CPU) or
    writing the next row's entries (CUDA). With our worker the rows hold the whole reservation."""
    extra = original(*args, **kwargs)
    if impl() == "ours":
        from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
        from sglang.srt.runtime_context import get_context

        if getattr(get_context().server_args, "_dflash_settings", None) is not None:
            extra = max(extra, get_alloc_reserve_per_decode(*args, **kwargs))
    return extra


def _validate_request(original, req, enable_overlap):
    if impl() != "ours":
        return original(req, enable_overlap)
    # SGLang 0.5.17 refuses return_logprob for DFLASH (its builtin computed no speculative logprobs); ours does.
    logprob, req.return_logprob = req.return_logprob, False
    try:
        error = original(req, enable_overlap)
    finally:
        req.return_logprob = logprob
    if error is None:
        from .requests import refusal

        error = refusal(req)
    return error


def _validate_input(original, manager, obj, input_ids):
    original(manager, obj, input_ids)
    if not _ours(manager.server_args) or not hasattr(obj, "sampling_params"):  # embedding requests: not ours
        return
    from .requests import input_refusal

    vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    error = input_refusal(obj, input_ids, vocab)
    if error is not None:
        raise ValueError(error)


_registered = False


def register() -> None:
    """Entry point (zero-argument, run for its side effects by SGLang's `load_plugins`).

    A bad DFLASH_SGLANG_IMPL value is reported by the hooks when they run (ServerArgs resolution), not here:
    SGLang only logs exceptions raised by plugins and would silently keep the builtin.
    """
    global _registered
    require_supported_sglang()
    _patch_engine_kwargs()
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from ..draft.memory import CELL_SIZE, cell_size_hook
    from ..scale.disagg import pd_hooks
    from ..scale.retraction import retraction_hooks
    from ..step.cpu import (
        allocate_token_bitmask_hook,
        apply_vocab_mask_hook,
        assign_req_to_token_pool_hook,
        kv_copy_warmup_hook,
    )

    for target, hook in (
        (ADD_CLI_ARGS, _add_cli_args), (FROM_CLI_ARGS, _from_cli_args),
        (CREATE_WORKER, _create_worker), (HANDLE_SPEC, _handle_speculative_decoding), (HANDLE_ARGS, _handle_dflash),
        (VALIDATE_REQUEST, _validate_request), (VALIDATE_INPUT, _validate_input), (MASK_POLICY, _verify_mask_policy),
        (ROW_HEADROOM, _row_headroom), (CELL_SIZE, cell_size_hook),
        (KV_COPY_WARMUP, kv_copy_warmup_hook), (ASSIGN_REQ_TO_TOKEN, assign_req_to_token_pool_hook),
        (GRAMMAR_BITMASK, allocate_token_bitmask_hook), (GRAMMAR_APPLY, apply_vocab_mask_hook),
        *version_hooks(), *pd_hooks(), *retraction_hooks(),
    ):
        HookRegistry.register(target, hook, HookType.AROUND)
    _registered = True
