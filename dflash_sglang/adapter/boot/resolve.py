"""Server-arg resolution for `--speculative-algorithm DFLASH` when dflash_sglang serves it: flags -> `DFlashSettings`.

Runs once, in the process that builds ServerArgs and before any scheduler starts, so every start-up error is one
line naming the flag, file or field (no check runs again in the worker):

- `precheck` (before SGLang's generic speculative handling): refuses what we do not serve (flags, retired
  environment variables), fetches a hub draft id to its local snapshot and reads the draft config. It also takes
  `--speculative-adaptive` out of SGLang's hands: SGLang's meaning (EAGLE's step count by acceptance) does not
  apply to DFLASH, ours (the verify shape by batch size) does.
- `handle_dflash_args` (replaces SGLang's `_handle_dflash`, which refuses CPU): checks the draft against the target
  (config, weight headers, hybrid linear-attention layers), resolves the mode and shape, declares what SGLang must
  size from it and attaches the settings to the record (adapter/settings.py); the mode and shape: boot/mode.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_sglang.core.draft.checkpoint import check_weight_headers
from dflash_sglang.core.draft.config import DraftConfig, recurrent_layers

from ..draft.context_rows import ring_size
from ..draft.memory import draft_memory
from ..settings import DFlashSettings, UnsupportedFlagError
from ..simulate import STEP_COST_ENV, SimulatedAcceptance, simulated_step_cost
from ..versions import declare, model_config, view
from .draft_checks import (
    SOURCE,
    check_draft_fits,
    draft_attention,
    draft_graphs,
    draft_window,
    resolve_draft_path,
    token_map_path,
)
from .flags import plugin_flags_of, refuse_retired_env
from .mode import DEFAULT_MAX_RUNNING_REQUESTS, resolve_shape, running_limits
from .refusals import check_supported_env, check_supported_flags, disaggregation, draft_kv_dtype

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precheck:
    """What `precheck` read before SGLang's handling, for `handle_dflash_args` (bookkeeping on the record)."""

    flags: dict[str, Any]  # our flags, and the operator's own values of the SGLang flags SGLang's handling rewrites
    draft: DraftConfig  # the draft's config.json, parsed once


def precheck(server_args: ServerArgs) -> None:
    """Before SGLang's own speculative handling: refuse what we do not serve, fetch a hub draft, fail on an
    unreadable draft config, and keep our raw inputs that SGLang's handling would rewrite."""
    refuse_retired_env()
    check_supported_env()
    cfg = view(server_args)
    check_supported_flags(cfg, bool(plugin_flags_of(server_args)["speculative_dflash_experimental"]))
    resolve_draft_path(server_args)
    draft = DraftConfig.load(view(server_args).speculative_draft_model_path)
    # The operator's own values: SGLang would turn --speculative-adaptive off for DFLASH (EAGLE-only there), and may
    # pick a draft attention backend for its own draft runner.
    flags = {**plugin_flags_of(server_args), "speculative_adaptive": bool(cfg.speculative_adaptive),
             "speculative_draft_attention_backend": server_args.speculative_draft_attention_backend}
    setattr(server_args, "_dflash_precheck", Precheck(flags, draft))  # bookkeeping, not a field: allowed when sealed
    if cfg.speculative_adaptive:
        declare(server_args, SOURCE, speculative_adaptive=False)  # SGLang's EAGLE adaptive machinery stays off


def handle_dflash_args(server_args: ServerArgs) -> DFlashSettings:
    """SGLang's `_handle_dflash`, ours: resolve, declare and attach the settings (the AROUND hook calls this, after
    the precheck on SGLang's `handle_speculative_decoding`)."""
    checked = getattr(server_args, "_dflash_precheck", None)
    assert checked is not None, "precheck ran first (the hook on handle_speculative_decoding)"
    flags, cfg = checked.flags, view(server_args)
    draft = check_draft_fits(server_args, checked.draft, bool(flags["speculative_dflash_experimental"]))
    dummy = cfg.speculative_draft_load_format == "dummy"
    if not dummy:
        check_weight_headers(cfg.speculative_draft_model_path, draft)
    requested = None if cfg.max_running_requests is None else int(cfg.max_running_requests)
    simulation = SimulatedAcceptance.from_env()
    mode, block, max_nodes, topk, table = resolve_shape(server_args, draft, flags, requested, simulation)
    max_running, budget = running_limits(mode, max_nodes, requested, flags["speculative_dflash_adaptive_token_budget"])
    graphs = draft_graphs(flags["speculative_dflash_draft_graphs"])
    attention = draft_attention(flags["speculative_draft_attention_backend"], str(cfg.device))
    window = None
    if cfg.speculative_draft_window_size is not None:
        window = draft_window(cfg, draft, mode, block, topk, attention)
        topk = window.topk
        if window.ring:
            # the rings are allocated per request slot when the worker is built (adapter/draft/memory.py): a known cap
            max_running = max_running if max_running is not None else DEFAULT_MAX_RUNNING_REQUESTS
    step_cost = simulated_step_cost()
    target, kv_dtype = model_config(server_args), draft_kv_dtype(cfg)
    if step_cost is not None and mode != "goodput":
        raise UnsupportedFlagError(f"{STEP_COST_ENV}: a simulated step cost feeds the goodput controller, which this "
                                   f"server does not run ({mode} mode): unset it, or drop the shape flags")
    settings = DFlashSettings(
        draft_dir=str(cfg.speculative_draft_model_path), draft=draft, mode=mode, block_size=block, max_nodes=max_nodes,
        topk=topk, max_running_requests=max_running, device=str(cfg.device),
        draft_attention=attention, draft_graphs=graphs, draft_kv_dtype=kv_dtype,
        draft_window=None if window is None else window.window,
        draft_window_why=None if window is None else window.why,
        draft_memory=draft_memory(draft, kv_dtype, target.dtype, None if window is None else window.window,
                                  ring_size(window.window, max_nodes) if window is not None and window.ring else 0),
        context_len=int(target.context_len),
        tree_cuda_graph=bool(flags["speculative_dflash_tree_cuda_graph"]) and topk > 1,
        dummy_draft=dummy, adaptive_table=table,
        token_map=token_map_path(cfg.speculative_token_map, str(cfg.speculative_draft_model_path), draft),
        adaptive_token_budget=budget,
        simulation=simulation, step_cost=step_cost, disaggregation=disaggregation(cfg),
        hybrid=recurrent_layers(target.hf_config) is not None,
    )
    if simulation is not None and not simulation.serves(mode):
        raise UnsupportedFlagError(f"{simulation.variable}: simulated acceptance forces a chain's commit length; "
                                   f"unset it for {'tree verification' if mode == 'tree' else 'adaptive tables'}")
    if cfg.speculative_num_steps not in (None, 1):
        logger.warning("DFLASH: --speculative-num-steps %s is ignored (one drafter pass per step)",
                       cfg.speculative_num_steps)
    # SGLang sizes the KV reservation and buffers from N (the most any step verifies) and num_steps.
    decisions = dict(speculative_num_draft_tokens=max_nodes, speculative_dflash_block_size=block,
                     speculative_eagle_topk=topk, speculative_num_steps=1)
    if max_running is not None:  # (None: SGLang sizes it from the KV pool, as for plain decoding)
        decisions["max_running_requests"] = max_running
    if cfg.enable_mixed_chunk:
        decisions["enable_mixed_chunk"] = False
        logger.warning("DFLASH (dflash-sglang): --enable-mixed-chunk is turned off (decode and prefill run as "
                       "separate batches)")
    if str(cfg.device) == "cpu" and not cfg.disable_overlap_schedule:
        # SGLang has no overlap scheduler for speculative decoding on CPU; run the worker synchronously.
        decisions["disable_overlap_schedule"] = True
    declare(server_args, SOURCE, **decisions)
    setattr(server_args, "_dflash_settings", settings)
    return settings
