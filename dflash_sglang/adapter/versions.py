"""The SGLang version seam: every difference between the SGLang releases we serve on lives here, nowhere else.

Admitted: SGLang 0.5.17 .. 0.5.23, the seven releases (see docs/versions.md, "Supported versions"). The version string
only admits the release; every difference is decided by probing what the installed SGLang has (a symbol, a signature,
a stand-in call), each probe named after the form it detects and cached (one SGLang per process). Release by
release, what each function adapts (upstream symbol, and the first release with the newer form):

- ServerArgs resolution (`sealed_resolution`, 0.5.19: `ServerArgs.resolve_once`): inside `ServerArgs.__post_init__`,
  plain assignment -> `ServerArgs.resolve_once()`, the record sealed while resolving: decisions go through
  `arg_groups.overrides.declare_resolution`; reading a resolved value: the field itself -> `overrides.
  resolution_result` (the fields keep the operator's raw input); a live read view: `overrides.resolved_view` ->
  `arg_groups.model_override_base.resolving_view`; the target's ModelConfig: `ServerArgs.get_model_config()` ->
  `model_override_base.model_config_of(server_args)`;
- the simulated-acceptance sampler (`public_acc_len_sampler`, 0.5.18): `spec_utils._sample_simulated_acc_len` ->
  `spec_utils.sample_simulated_acc_len`;
- finishing a multi-token commit, `schedule_batch.Req.update_finish_state` (`stops_before_cap`, 0.5.18, which added
  `Req._cap_finished_len_at_max_new_tokens` with the reorder): 0.5.17 checks max_new_tokens before stop strings and
  stop tokens, so a step that reaches the cap keeps the tokens after a stop it accepted earlier (plain decoding, one
  token a step, stops there); later releases check stops first. `finish_like_plain` hooks the length-first form;
- the tokens min_new_tokens holds back, `penaltylib.BatchedMinNewTokensPenalizer._prepare` (`min_new_tokens_holds_eos`,
  0.5.19; no symbol marks it, so a stand-in request asks): adds the request's `eos_token_ids` (the model's
  generation-config EOS) to the stop token ids and the tokenizer's EOS ids;
- the server's hidden-states mode, `forward_batch_info.get_server_return_hidden_states_mode` (its signature, 0.5.18):
  `(server_args)` -> `()` (reads the exec features);
- a hybrid target's prefix-cache state-tracking grid (`mamba_track_interval`, 0.5.19: `runtime_context.
  mamba_track_grid`): `get_exec().mamba.mamba_track_interval` -> `mamba_track_grid(page_size)`;
- DP attention (`attention_dp`, 0.5.22: the `attn_dp_size` field): `--enable-dp-attention` with `--dp-size` groups ->
  `--attn-dp-size` groups (the old spelling rewritten before any other resolution step);
- the draft KV dtype (`draft_kv_cache_dtype`, 0.5.18: the `speculative_draft_kv_cache_dtype` field, default following
  `--kv-cache-dtype`): none -> the draft pool follows `--kv-cache-dtype` as the target's pool does;
- PD disaggregation (`pd_disaggregation_supported`, 0.5.20: `speculative/dflash_disaggregation.py` gains
  `build_dflash_disagg_draft_input`, which `SpeculativeAlgorithm.build_disagg_draft_input` calls for DFLASH; 0.5.18
  and 0.5.19 ship the module without a DFLASH caller): none -> the decode server relays DFLASH's state;
- DP attention in our worker (`attention_dp_served`, 0.5.23: coordinated per-step row counts on ScheduleBatch, the
  runtime layout and the attention-TP group accessor): none -> DP attention refused, naming the release;
- HiCache with our draft pool (`hicache_draft_served`, 0.5.23: the spec worker's `HiCacheDraftPlan` and host pools
  built from a pool's buffer description, `mem_cache/device_pool_info.MHABufferInfo`; 0.5.18 .. 0.5.22 build a draft
  sidecar's host pool from SGLang's own pool object): none -> `--enable-hierarchical-cache` refused, naming the
  release;
- a request's req_to_token row (`req_kv_info`, by 0.5.23: the `req_pool_idx` field of `schedule_batch.ReqKvInfo`, the
  request's `kv`): `req.req_pool_idx` -> `req.kv.req_pool_idx` (`req_pool_index`, what the PD decode retraction backup
  indexes req_to_token with).

What did not change (checked against the seven wheels): the plugin entry-point group and `HookRegistry`, the hooked
symbols (adapter/boot/plugin.py), `DFlashDraftInputV2` / `DFlashVerifyInput`, `get_context().server_args`, and the
spec-worker constructor keywords (0.5.17 .. 0.5.20 add `ps`, which the worker takes as an optional keyword).
"""
from __future__ import annotations

import importlib.util
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from inspect import signature
from typing import Any

SUPPORTED = tuple(f"0.5.{n}" for n in range(17, 24))  # the admitted range only: differences are probed, below
NEWEST = SUPPORTED[-1]


class UnsupportedSGLangError(ImportError):
    """The installed SGLang is not a version this adapter was written against."""


def require_supported_sglang() -> str:
    """The installed SGLang version, or one line naming the supported set (raised at plugin import, so SGLang logs
    it and keeps its builtin DFLASH)."""
    supported = f"sglang {SUPPORTED[0]} .. {NEWEST}"
    try:
        found = version("sglang")
    except PackageNotFoundError:
        raise UnsupportedSGLangError(
            f"dflash_sglang.adapter needs {supported}, but sglang is not installed "
            f"(pip install 'dflash-sglang[sglang]')"
        ) from None
    if found not in SUPPORTED:
        raise UnsupportedSGLangError(
            f"dflash_sglang.adapter supports {supported} only, found sglang=={found}: install sglang=={NEWEST}, "
            f"or uninstall dflash-sglang to use SGLang's builtin DFLASH"
        )
    return found


SGLANG_VERSION = require_supported_sglang()  # for messages (a refused feature names the release), never a branch


@cache
def sealed_resolution() -> bool:
    """ServerArgs resolves in `ServerArgs.resolve_once()`, sealed (declare_resolution, raw fields); else inside
    `__post_init__` by plain assignment."""
    from sglang.srt.server_args import ServerArgs

    return hasattr(ServerArgs, "resolve_once")


@cache
def public_acc_len_sampler() -> bool:
    """The simulated-acceptance sampler is `spec_utils.sample_simulated_acc_len` (else `_sample_simulated_acc_len`)."""
    from sglang.srt.speculative import spec_utils

    return hasattr(spec_utils, "sample_simulated_acc_len")


@cache
def stops_before_cap() -> bool:
    """`Req.update_finish_state` checks stop strings and tokens before max_new_tokens; the helper that caps a stop's
    finish at max_new_tokens came with that order."""
    from sglang.srt.managers.schedule_batch import Req

    return hasattr(Req, "_cap_finished_len_at_max_new_tokens")


@cache
def min_new_tokens_holds_eos() -> bool:
    """SGLang's min_new_tokens penalizer also holds back the request's `eos_token_ids`: asked of its `_prepare` on a
    stand-in request whose only such id is in `eos_token_ids` (no symbol marks the change)."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer

    eos, other, vocab = 1, 2, 4

    class Orchestrator:  # (the penalizer holds it by weak reference)
        device, vocab_size = "cpu", vocab

        @staticmethod
        def reqs() -> list[Any]:
            return [SimpleNamespace(sampling_params=SimpleNamespace(min_new_tokens=1, stop_token_ids=None),
                                    eos_token_ids={eos},
                                    tokenizer=SimpleNamespace(additional_stop_token_ids=None, eos_token_id=other))]

    orchestrator = Orchestrator()
    penalizer = BatchedMinNewTokensPenalizer(orchestrator)
    penalizer._prepare()
    return bool(torch.isinf(penalizer.stop_token_penalties[0, eos]))


@cache
def hidden_mode_reads_server_args() -> bool:
    """`get_server_return_hidden_states_mode` takes the server args (else no argument: it reads the exec features)."""
    from sglang.srt.model_executor.forward_batch_info import get_server_return_hidden_states_mode

    return len(signature(get_server_return_hidden_states_mode).parameters) > 0


@cache
def cpu_bind_entry_per_rank() -> bool:
    """SGLANG_CPU_OMP_THREADS_BIND takes one entry per rank of dp x tp (`numa_utils.init_threads_binding(numa_index,
    world_size)`; else one per TP rank, `(tp_rank, tp_size)`, which every data-parallel replica shares)."""
    from sglang.srt.utils import numa_utils

    return "numa_index" in signature(numa_utils.init_threads_binding).parameters


@cache
def has_attn_dp_size() -> bool:
    """ServerArgs has the `attn_dp_size` field (`--attn-dp-size`; else DP attention is `--enable-dp-attention`)."""
    from sglang.srt.server_args import ServerArgs

    return hasattr(ServerArgs, "attn_dp_size")


@cache
def has_mamba_track_grid() -> bool:
    """`runtime_context.mamba_track_grid(page_size)` gives the hybrid prefix cache's tracking grid (else the exec
    features' `mamba.mamba_track_interval`)."""
    from sglang.srt import runtime_context

    return hasattr(runtime_context, "mamba_track_grid")


@cache
def req_kv_info() -> bool:
    """A request keeps its req_to_token row in its KV bookkeeping, `req.kv.req_pool_idx` (a field of
    `schedule_batch.ReqKvInfo`); else on the request itself (`req.req_pool_idx`)."""
    import dataclasses

    from sglang.srt.managers import schedule_batch

    info = getattr(schedule_batch, "ReqKvInfo", None)
    return info is not None and "req_pool_idx" in {f.name for f in dataclasses.fields(info)}


def req_pool_index(req: Any) -> int:
    """A request's row of req_to_token."""
    return req.kv.req_pool_idx if req_kv_info() else req.req_pool_idx


# Every probe by name (those above; `pd_disaggregation_supported` below, beside the refusal it decides): the forms of
# the installed SGLang. tests/test_sglang_versions.py checks each against what the module it names actually has;
# tests/sglang_support.py reports them to tests that do not import sglang.
PROBES = ("sealed_resolution", "public_acc_len_sampler", "stops_before_cap", "min_new_tokens_holds_eos",
          "hidden_mode_reads_server_args", "cpu_bind_entry_per_rank", "has_mamba_track_grid", "has_attn_dp_size",
          "pd_disaggregation_supported", "has_draft_kv_cache_dtype", "attention_dp_served", "hicache_draft_served",
          "req_kv_info")


def resolve(server_args: Any) -> Any:
    """Run SGLang's ServerArgs resolution if construction did not (`ServerArgs.resolve_once`); returns the record.
    Launchers do this themselves; tests and scripts that build a ServerArgs call this."""
    if sealed_resolution():
        server_args.resolve_once()
    return server_args


def view(server_args: Any) -> Any:
    """A read-only view of what resolution has decided so far, over the raw fields (during and after resolution)."""
    if sealed_resolution():
        from sglang.srt.arg_groups.model_override_base import resolving_view

        return resolving_view(server_args)
    from sglang.srt.arg_groups.overrides import resolved_view

    return resolved_view(server_args)  # a snapshot: build a new one after declaring


def declare(server_args: Any, source: str, **fields: Any) -> None:
    """Record resolution decisions (`overrides.declare_resolution` where the record is sealed, as assignment raises
    while resolving; else plain assignment)."""
    if sealed_resolution() and hasattr(server_args, "resolve_once"):
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, source, **fields)
        return
    for name, value in fields.items():
        setattr(server_args, name, value)


def resolved_value(server_args: Any, field: str) -> Any:
    """A field's value after resolution (a sealed record keeps the operator's raw input in the field itself)."""
    if sealed_resolution() and hasattr(server_args, "resolve_once"):
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(server_args, field)
    return getattr(server_args, field)


@cache
def has_draft_kv_cache_dtype() -> bool:
    """ServerArgs has `speculative_draft_kv_cache_dtype` (`--speculative-draft-kv-cache-dtype`)."""
    from sglang.srt.server_args import ServerArgs

    return hasattr(ServerArgs, "speculative_draft_kv_cache_dtype")


def draft_kv_cache_dtype(cfg: Any) -> tuple[str, str]:
    """(flag, SGLang dtype name) the draft KV pool is stored in, from a read view: `--speculative-draft-kv-cache-dtype`
    where SGLang has it and it is set, else `--kv-cache-dtype` (SGLang's meaning: the draft follows the target's KV
    dtype by default); "auto" = the model dtype."""
    if has_draft_kv_cache_dtype():
        value = getattr(cfg, "speculative_draft_kv_cache_dtype", None)
        if value is not None:
            return "--speculative-draft-kv-cache-dtype", str(value)
    return "--kv-cache-dtype", str(getattr(cfg, "kv_cache_dtype", None) or "auto")


def model_config(server_args: Any) -> Any:
    """The target's SGLang ModelConfig for these server args."""
    if sealed_resolution():
        from sglang.srt.arg_groups.model_override_base import model_config_of

        return model_config_of(server_args)
    return server_args.get_model_config()


def sample_simulated_acc_len(mean: float, method: str, block_size: int) -> int:
    """SGLang's simulated-acceptance sampler (renamed in 0.5.18), so both workers draw the same law."""
    from sglang.srt.speculative import spec_utils

    sampler = spec_utils.sample_simulated_acc_len if public_acc_len_sampler() else spec_utils._sample_simulated_acc_len
    return sampler(mean, method, block_size)


def min_new_tokens_stop_ids(req: Any) -> tuple[int, ...]:
    """The token ids SGLang's min_new_tokens penalizer masks for this Req while its output is short, sorted."""
    tokenizer = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or ())
    if min_new_tokens_holds_eos():
        ids |= set(getattr(req, "eos_token_ids", None) or ())
    if tokenizer is not None:
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(i for i in ids if i is not None))


def prefill_hidden_full(batch: Any, server_args: Any) -> bool:
    """Whether the scheduler reads a prefill's hidden states in FULL mode (every extend row; else one row per
    request), as its `BatchResultProcessor._get_prefill_hidden_capture_mode` decides."""
    from sglang.srt.model_executor.forward_batch_info import (
        get_required_capture_hidden_mode,
        get_server_return_hidden_states_mode,
    )

    server = (get_server_return_hidden_states_mode(server_args) if hidden_mode_reads_server_args()
              else get_server_return_hidden_states_mode())
    return get_required_capture_hidden_mode(max(batch.return_hidden_states_mode, server), batch.spec_info).is_full()


def attention_dp(cfg: Any) -> tuple[str, int] | None:
    """DP attention in these resolved args: (the flag that spells it, its group count), or None when off.

    Up to 0.5.21: `--enable-dp-attention` makes the `--dp-size` replicas attention-DP groups. From 0.5.22:
    `--attn-dp-size N`; its first resolution step (`parallel_hook.handle_deprecated_dp_attention`) rewrites the older
    spelling into `attn_dp_size=N, dp_size=1, enable_dp_attention=False`, and an elastic-EP scale joiner runs the
    DP-attention paths even in a group of one (`runtime_context.attn_dp_enabled_of`). Decided by what the record has
    (`has_attn_dp_size` asks the class), not the version."""
    if hasattr(cfg, "attn_dp_size"):
        from sglang.srt.runtime_context import attn_dp_enabled_of

        return ("--attn-dp-size", int(cfg.attn_dp_size)) if attn_dp_enabled_of(cfg) else None
    return ("--enable-dp-attention --dp-size", int(cfg.dp_size or 1)) if cfg.enable_dp_attention else None


@cache
def pd_disaggregation_supported() -> bool:
    """Whether this SGLang can serve DFLASH across PD disaggregation: its decode server builds the relayed DFLASH state
    from the transferred first token (`speculative/dflash_disaggregation.py: build_dflash_disagg_draft_input`, reached
    from `SpeculativeAlgorithm.build_disagg_draft_input`; before 0.5.20 that builds EAGLE's and DSpark's only, and
    0.5.18 / 0.5.19 ship the module with a `build_dflash_family_disagg_draft_input` nothing calls) and reads the spec
    worker's draft pool for the transfer. Decided by what the installed SGLang has."""
    if importlib.util.find_spec("sglang.srt.speculative.dflash_disaggregation") is None:
        return False
    from sglang.srt.speculative import dflash_disaggregation

    return hasattr(dflash_disaggregation, "build_dflash_disagg_draft_input")


@cache
def attention_dp_served() -> bool:
    """Whether our worker can run under DP attention here: each step it writes every attention-DP group's row count
    itself (`ScheduleBatch.dp_spec_prefill_coordination_applied`, 0.5.21: counts SGLang then neither rescales by the
    local verify width nor pads to one forward mode), and reaches the runtime layout and the attention-TP group
    (`runtime_context.get_parallel`, `dp_attention.get_dp_tp_group`, 0.5.23). Decided by what the installed SGLang
    has (adapter/scale/dp_attention.py)."""
    from sglang.srt import runtime_context
    from sglang.srt.layers import dp_attention
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return (hasattr(ScheduleBatch, "dp_spec_prefill_coordination_applied") and hasattr(runtime_context, "get_parallel")
            and hasattr(dp_attention, "get_dp_tp_group"))


@cache
def hicache_draft_served() -> bool:
    """Whether HiCache can offload our draft pool here: the spec worker hands the scheduler a `HiCacheDraftPlan`
    (`speculative/base_spec_worker.py`, SIDECAR: a draft pool whose slots follow the target's) and SGLang builds the
    sidecar's host pool from the pool's buffer description (`mem_cache/device_pool_info.py` `MHABufferInfo`, read
    through `get_device_pool_infos`), which adapter/scale/hicache.py gives. Decided by what the installed SGLang has."""
    from sglang.srt.speculative import base_spec_worker

    mode = getattr(base_spec_worker, "HiCacheDraftMode", None)
    return (mode is not None and hasattr(mode, "SIDECAR")
            and importlib.util.find_spec("sglang.srt.mem_cache.device_pool_info") is not None
            and hasattr(importlib.import_module("sglang.srt.mem_cache.device_pool_info"), "MHABufferInfo"))


def attention_tp_group() -> Any:
    """The ranks that share one batch: the attention-TP group under DP attention, else the TP group."""
    if attention_dp_served():
        from sglang.srt.layers.dp_attention import get_dp_tp_group

        return get_dp_tp_group()
    from sglang.srt.distributed import get_tp_group

    return get_tp_group()


FINISH_STATE = "sglang.srt.managers.schedule_batch.Req.update_finish_state"


def mamba_track_interval(page_size: int) -> int:
    """Every how many tokens a hybrid target's prefix cache keeps a copy of the recurrent state (the tracking slots a
    verify may have to fill; adapter/step/hybrid.py)."""
    if not has_mamba_track_grid():
        from sglang.srt.runtime_context import get_exec

        return int(get_exec().mamba.mamba_track_interval)
    from sglang.srt.runtime_context import mamba_track_grid

    return int(mamba_track_grid(page_size))


def version_hooks() -> tuple[tuple[str, Any], ...]:
    """(upstream symbol, AROUND hook) pairs that only the installed SGLang needs (adapter/boot/plugin.py registers
    them)."""
    return () if stops_before_cap() else ((FINISH_STATE, finish_like_plain),)


def finish_like_plain(original, req: Any, new_accepted_len: int = 1) -> None:
    """A length-first `Req.update_finish_state` (0.5.17) for our DFLASH worker's multi-token commits: a step of k tokens
    that reaches max_new_tokens finishes as k one-token steps of plain decoding would, i.e. at a stop string or stop
    token that comes before the cap (length-first ended such a step by length, keeping the tokens after the stop), and
    by length when the stop is the cap's own token (as plain 0.5.17 does). Other steps, and other workers, are
    untouched."""
    params = req.sampling_params
    cap = params.max_new_tokens
    if (new_accepted_len <= 1 or cap is None or len(req.output_ids) < cap or req.finished() or req.to_finish
            or not _our_worker_serves()):
        return original(req, new_accepted_len)
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    params.max_new_tokens = len(req.output_ids) + 1  # the stop checks first, the length check passed
    try:
        original(req, new_accepted_len)
    finally:
        params.max_new_tokens = cap
    if req.finished() and (req.finished_len is None or req.finished_len < cap):
        return  # stopped before the cap, as plain decoding would have
    req.finished_reason, req.finished_len = FINISH_LENGTH(length=cap), cap


def _our_worker_serves() -> bool:
    """This scheduler's server args were resolved for our DFLASH worker (never with DFLASH_SGLANG_IMPL=builtin)."""
    from sglang.srt.runtime_context import get_context

    return getattr(get_context().server_args, "_dflash_settings", None) is not None
