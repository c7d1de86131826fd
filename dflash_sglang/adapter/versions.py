"""The SGLang version seam: every difference between the SGLang releases we serve on lives here, nowhere else.

Supported: SGLang 0.5.17 and 0.5.23 (see docs/sglang.md, "Supported versions"). Each function below names the
upstream symbol it adapts and what changed (0.5.17 -> 0.5.23):

- ServerArgs resolution: inside `ServerArgs.__post_init__`, plain assignment -> `ServerArgs.resolve_once()`, the
  record sealed while resolving: decisions go through `arg_groups.overrides.declare_resolution`;
- reading a resolved value: the field itself (declarations are materialized at the end) ->
  `overrides.resolution_result` (the fields keep the operator's raw input);
- a live read view while resolving: `overrides.resolved_view` -> `arg_groups.model_override_base.resolving_view`;
- the target's ModelConfig: `ServerArgs.get_model_config()` -> `model_override_base.model_config_of(server_args)`;
- the simulated-acceptance sampler: `spec_utils._sample_simulated_acc_len` -> `spec_utils.sample_simulated_acc_len`;
- finishing a multi-token commit, `schedule_batch.Req.update_finish_state`: 0.5.17 checks max_new_tokens before stop
  strings and stop tokens, so a step that reaches the cap keeps the tokens after a stop it accepted earlier (plain
  decoding, one token a step, stops there); 0.5.23 checks stops first. `finish_like_plain` hooks 0.5.17's;
- the tokens min_new_tokens holds back (`penaltylib.BatchedMinNewTokensPenalizer`): 0.5.23 adds the request's
  `eos_token_ids` (the model's generation-config EOS) to the stop token ids and the tokenizer's EOS ids;
- the server's hidden-states mode, `forward_batch_info.get_server_return_hidden_states_mode`: from `server_args` ->
  from the exec features (no argument);
- PD disaggregation (`pd_disaggregation_supported`): no DFLASH path -> `speculative/dflash_disaggregation.py`;
- DP attention (`attention_dp`): `--enable-dp-attention` with `--dp-size` groups -> `--attn-dp-size` groups (the
  old spelling rewritten before any other resolution step);
- a hybrid target's prefix-cache state-tracking grid (`mamba_track_interval`): `get_exec().mamba.mamba_track_interval`
  -> `runtime_context.mamba_track_grid(page_size)`.

What did not change (checked against both wheels): the plugin entry-point group and `HookRegistry`, the hooked
symbols (adapter/plugin.py), `DFlashDraftInputV2` / `DFlashVerifyInput`, `get_context().server_args`, and the
spec-worker constructor keywords (0.5.17 adds `ps`, which the worker takes as an optional keyword).
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

SUPPORTED = ("0.5.17", "0.5.23")
NEWEST = SUPPORTED[-1]


class UnsupportedSGLangError(ImportError):
    """The installed SGLang is not a version this adapter was written against."""


def require_supported_sglang() -> str:
    """The installed SGLang version, or one line naming the supported set (raised at plugin import, so SGLang logs
    it and keeps its builtin DFLASH)."""
    supported = " or ".join(f"sglang=={v}" for v in SUPPORTED)
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


SGLANG_VERSION = require_supported_sglang()
_SEALED_RESOLUTION = SGLANG_VERSION != "0.5.17"  # 0.5.23: resolve_once(), declare_resolution, raw fields


def resolve(server_args: Any) -> Any:
    """Run SGLang's ServerArgs resolution if construction did not (0.5.23: `ServerArgs.resolve_once`); returns the
    record. Launchers do this themselves; tests and scripts that build a ServerArgs call this."""
    if _SEALED_RESOLUTION:
        server_args.resolve_once()
    return server_args


def view(server_args: Any) -> Any:
    """A read-only view of what resolution has decided so far, over the raw fields (during and after resolution)."""
    if _SEALED_RESOLUTION:
        from sglang.srt.arg_groups.model_override_base import resolving_view

        return resolving_view(server_args)
    from sglang.srt.arg_groups.overrides import resolved_view

    return resolved_view(server_args)  # a snapshot: build a new one after declaring


def declare(server_args: Any, source: str, **fields: Any) -> None:
    """Record resolution decisions (`overrides.declare_resolution` on 0.5.23, where assignment raises while
    resolving; plain assignment on 0.5.17)."""
    if _SEALED_RESOLUTION and hasattr(server_args, "resolve_once"):
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, source, **fields)
        return
    for name, value in fields.items():
        setattr(server_args, name, value)


def resolved_value(server_args: Any, field: str) -> Any:
    """A field's value after resolution (0.5.23 keeps the operator's raw input in the field itself)."""
    if _SEALED_RESOLUTION and hasattr(server_args, "resolve_once"):
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(server_args, field)
    return getattr(server_args, field)


def model_config(server_args: Any) -> Any:
    """The target's SGLang ModelConfig for these server args."""
    if _SEALED_RESOLUTION:
        from sglang.srt.arg_groups.model_override_base import model_config_of

        return model_config_of(server_args)
    return server_args.get_model_config()


def sample_simulated_acc_len(mean: float, method: str, block_size: int) -> int:
    """SGLang's simulated-acceptance sampler (renamed in 0.5.23), so both workers draw the same law."""
    from sglang.srt.speculative import spec_utils

    sampler = spec_utils.sample_simulated_acc_len if _SEALED_RESOLUTION else spec_utils._sample_simulated_acc_len
    return sampler(mean, method, block_size)


def min_new_tokens_stop_ids(req: Any) -> tuple[int, ...]:
    """The token ids SGLang's min_new_tokens penalizer masks for this Req while its output is short, sorted."""
    tokenizer = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or ())
    if _SEALED_RESOLUTION:
        ids |= set(getattr(req, "eos_token_ids", None) or ())
    if tokenizer is not None:
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(i for i in ids if i is not None))


def prefill_hidden_full(batch: Any, server_args: Any) -> bool:
    """Whether the scheduler reads a prefill's hidden states in FULL mode (every extend row; else one row per
    request), as its `BatchResultProcessor._get_prefill_hidden_capture_mode` decides."""
    from sglang.srt.model_executor.forward_batch_info import (get_required_capture_hidden_mode,
                                                              get_server_return_hidden_states_mode)

    server = (get_server_return_hidden_states_mode() if _SEALED_RESOLUTION
              else get_server_return_hidden_states_mode(server_args))
    return get_required_capture_hidden_mode(max(batch.return_hidden_states_mode, server), batch.spec_info).is_full()


def attention_dp(cfg: Any) -> tuple[str, int] | None:
    """DP attention in these resolved args: (the flag that spells it, its group count), or None when off.

    0.5.17: `--enable-dp-attention` makes the `--dp-size` replicas attention-DP groups. 0.5.23: `--attn-dp-size N`;
    its first resolution step (`parallel_hook.handle_deprecated_dp_attention`) rewrites the older spelling into
    `attn_dp_size=N, dp_size=1, enable_dp_attention=False`, and an elastic-EP scale joiner runs the DP-attention paths
    even in a group of one (`runtime_context.attn_dp_enabled_of`). Decided by what the record has, not the version."""
    if hasattr(cfg, "attn_dp_size"):
        from sglang.srt.runtime_context import attn_dp_enabled_of

        return ("--attn-dp-size", int(cfg.attn_dp_size)) if attn_dp_enabled_of(cfg) else None
    return ("--enable-dp-attention --dp-size", int(cfg.dp_size or 1)) if cfg.enable_dp_attention else None


def pd_disaggregation_supported() -> bool:
    """Whether this SGLang can serve DFLASH across PD disaggregation: its decode server builds the relayed DFLASH state
    from the transferred first token (`speculative/dflash_disaggregation.py`, reached from
    `SpeculativeAlgorithm.build_disagg_draft_input`; 0.5.17's builds EAGLE's and DSpark's only) and reads the spec
    worker's draft pool for the transfer. Decided by what the installed SGLang has."""
    import importlib.util

    return importlib.util.find_spec("sglang.srt.speculative.dflash_disaggregation") is not None


FINISH_STATE = "sglang.srt.managers.schedule_batch.Req.update_finish_state"


def mamba_track_interval(page_size: int) -> int:
    """Every how many tokens a hybrid target's prefix cache keeps a copy of the recurrent state (the tracking slots a
    verify may have to fill; adapter/hybrid.py)."""
    if SGLANG_VERSION == "0.5.17":
        from sglang.srt.runtime_context import get_exec

        return int(get_exec().mamba.mamba_track_interval)
    from sglang.srt.runtime_context import mamba_track_grid

    return int(mamba_track_grid(page_size))


def version_hooks() -> tuple[tuple[str, Any], ...]:
    """(upstream symbol, AROUND hook) pairs that only this SGLang version needs (adapter/plugin.py registers them)."""
    return () if _SEALED_RESOLUTION else ((FINISH_STATE, finish_like_plain),)


def finish_like_plain(original, req: Any, new_accepted_len: int = 1) -> None:
    """SGLang 0.5.17's `Req.update_finish_state` for our DFLASH worker's multi-token commits: a step of k tokens that
    reaches max_new_tokens finishes as k one-token steps of plain decoding would, i.e. at a stop string or stop token
    that comes before the cap (0.5.17 ended such a step by length, keeping the tokens after the stop), and by length
    when the stop is the cap's own token (as plain 0.5.17 does). Other steps, and other workers, are untouched."""
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
