"""Server-arg resolution for `--speculative-algorithm DFLASH` when dflash_sglang serves it: flags -> `DFlashSettings`.

Runs once, in the process that builds ServerArgs and before any scheduler starts, so every start-up error is one
line naming the flag, file or field (no check runs again in the worker):

- `precheck` (before SGLang's generic speculative handling): refuses what we do not serve (flags, retired
  environment variables), fetches a hub draft id to its local snapshot and reads the draft config. It also takes
  `--speculative-adaptive` out of SGLang's hands: SGLang's meaning (EAGLE's step count by acceptance) does not
  apply to DFLASH, ours (the verify shape by batch size) does.
- `handle_dflash_args` (replaces SGLang's `_handle_dflash`, which refuses CPU): checks the draft against the target
  (config, weight headers, hybrid linear-attention layers), resolves the mode and shape, declares what SGLang must
  size from it and attaches the settings to the record (adapter/settings.py).

Shape per mode (N verify rows per request and step, B the drafter block, k the top-k):
- chain (`--speculative-eagle-topk` 1, the default): B = `--speculative-num-draft-tokens` (alias
  `--speculative-dflash-block-size`), default the checkpoint's `block_size`; N = B.
- tree (`--speculative-eagle-topk k`, k > 1): B = `--speculative-dflash-block-size` (default the checkpoint's);
  N = `--speculative-num-draft-tokens` (default B) nodes, root included, best-first over the top-k of each of the
  B-1 draft positions.
- goodput (no shape flag at all, or `--speculative-adaptive` without a table): B as for a tree; each step's chain
  (1..N rows) or tree (up to N nodes over top-2 / top-k) from the goodput controller (core/goodput.py: measured
  acceptance and step cost); N = the explicit `--speculative-num-draft-tokens` (at most B) or B; k =
  `--speculative-eagle-topk` (with `--speculative-adaptive`; 1: chains only) or DEFAULT_TREE_TOPK where the server can
  verify trees (page size 1, a tree-capable attention backend), else 1.
- adaptive (`--speculative-adaptive` with `--speculative-dflash-adaptive-table`): B as for a tree; each step's shape
  from the table by batch size; N = the largest shape it can pick (or the explicit `--speculative-num-draft-tokens`,
  which every row must fit), k = its largest top-k.
A shape flag (`--speculative-num-draft-tokens`, `--speculative-dflash-block-size`, `--speculative-eagle-topk`) without
`--speculative-adaptive` pins the shape (chain or tree), as does simulated acceptance (`SGLANG_SIMULATE_ACC_LEN`).
SGLang sizes its per-step KV reservation from the declared N (`DFlashDraftInputV2.prepare_for_decode` reserves
2*N slots past the committed length) and the result row stride from it.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_sglang.core.checkpoint import check_fit, check_weight_headers
from dflash_sglang.core.config import (CheckpointError, DraftConfig, gated_deltanet, recurrent_layers,
                                       sliding_window_layers)
from dflash_sglang.core.goodput import DEFAULT_TREE_TOPK
from dflash_sglang.core.token_map import TOKEN_MAP_FILE, load_token_map, read_token_map
from dflash_sglang.core.tree import max_tree_nodes
from dflash_sglang.ops import MAX_NODES, find_nvcc

from .adaptive import AdaptiveConfigError, adaptive_limits
from .draft_memory import draft_memory
from .draft_window import ring_size
from .settings import (DRAFT_ATTENTION, DRAFT_GRAPHS, IMPL_ENV, PLUGIN_DEFAULTS, DFlashSettings, plugin_flags_of,
                       refuse_retired_env)
from .simulate import STEP_COST_ENV, SimulatedAcceptance, simulated_step_cost
from .versions import (SGLANG_VERSION, attention_dp, attention_dp_served, declare, draft_kv_cache_dtype,
                       hicache_draft_served, model_config, pd_disaggregation_supported, view)

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEVICES = ("cuda", "cpu")
# --max-running-requests when unset, for pinned shapes (chain, tree, a table): the builtin DFLASH's default. The goodput
# controller leaves it to SGLang (as plain decoding: it shrinks the verify as the batch grows, down to plain steps)
# and instead bounds each step's verify rows by this many requests' worth of N rows (`running_limits`).
DEFAULT_MAX_RUNNING_REQUESTS = 48
# Target attention backends that take the tree mask: torch_native through adapter/tree_attention.py, the GPU
# ones through the verify input's `custom_mask` (the layout EAGLE's tree verify uses).
TREE_ATTENTION_BACKENDS = ("torch_native", "flashinfer", "triton")
SOURCE = "dflash_sglang"  # the source named in SGLang's declarations


class UnsupportedFlagError(ValueError):
    """A server flag (or flag combination) that dflash_sglang's DFLASH does not support yet."""


def _refuse(flag: str, value, why: str) -> None:
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
        _refuse("--device", device, f"only {' and '.join(DEVICES)} are supported")
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
            _refuse(flag, "" if value is True else value, why)
    if getattr(cfg, "enable_hierarchical_cache", False):
        check_hicache(bool(experimental))
    pd = disaggregation(cfg)
    if pd is not None and not pd_disaggregation_supported():
        _refuse("--disaggregation-mode", pd, f"SGLang {SGLANG_VERSION} has no DFLASH path for PD disaggregation "
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
        _refuse(flag, "", f"SGLang {SGLANG_VERSION} gives a DFLASH draft KV pool no HiCache host pool built from "
                "its buffers (0.5.23 has: the draft pool offloaded and loaded back with the target's)")
    if not experimental:
        _refuse(flag, "", f"HiCache is not yet validated end to end on a GPU with dflash-sglang: pass {EXPERIMENTAL} "
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
            _refuse(flag, groups, f"DP attention is not served by dflash-sglang on SGLang {SGLANG_VERSION} (0.5.23 "
                    "has what our step needs: per-step row counts for every attention-DP group)")
        if not experimental:
            _refuse(flag, groups, f"DP attention is not yet validated end to end on a GPU with dflash-sglang: pass "
                    f"{EXPERIMENTAL} to serve it with ours, or set {IMPL_ENV}=builtin")
        if not getattr(cfg, "enable_dp_lm_head", False):
            _refuse(flag, groups, "DFLASH under DP attention needs --enable-dp-lm-head: the drafter borrows the "
                    "target's lm_head, which must be split within each attention-DP group (its draft vocab merge "
                    "runs there, never across groups)")
        if os.environ.get("SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION", "").strip().lower() in ("1", "true"):
            _refuse(flag, groups, "SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION=1: our step writes each "
                    "attention-DP group's rows itself (unset it)")
    for flag, name, why in PARALLEL_REFUSALS:
        value = int(getattr(cfg, name, 1) or 1)
        if value != 1:
            _refuse(flag, value, why)
    if getattr(cfg, "enable_prefill_cp", False):
        _refuse("--enable-prefill-cp", "", "prefill context parallelism is not supported (each rank would capture "
                "target features for part of the prompt only)")


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
    mode, block, nodes, topk, table = resolve_shape(server_args, draft, flags, requested, simulation)
    max_running, budget = running_limits(mode, nodes, requested, flags["speculative_dflash_adaptive_token_budget"])
    graphs = draft_graphs(flags["speculative_dflash_draft_graphs"])
    if cfg.speculative_draft_window_size is not None:
        if mode == "goodput" and cfg.speculative_eagle_topk is None:
            topk = 1  # the window's rings serve chains: the controller's shapes are chains (1..N rows)
        window = draft_window(cfg, draft, block, topk, graphs)
        # its rings are allocated per request slot when the worker is built (adapter/draft_memory.py): a known cap
        max_running = max_running if max_running is not None else DEFAULT_MAX_RUNNING_REQUESTS
        graphs = "eager"  # (`auto`: draft_window refused `static`)
    else:
        window = None
    step_cost = simulated_step_cost()
    target, kv_dtype = model_config(server_args), draft_kv_dtype(cfg)
    if step_cost is not None and mode != "goodput":
        raise UnsupportedFlagError(f"{STEP_COST_ENV}: a simulated step cost feeds the goodput controller, which this "
                                   f"server does not run ({mode} mode): unset it, or drop the shape flags")
    settings = DFlashSettings(
        draft_dir=str(cfg.speculative_draft_model_path), draft=draft, mode=mode, block_size=block, nodes=nodes,
        topk=topk, max_running_requests=max_running, device=str(cfg.device),
        draft_attention=draft_attention(flags["speculative_draft_attention_backend"], str(cfg.device)),
        draft_graphs=graphs, draft_kv_dtype=kv_dtype, draft_window=window,
        draft_memory=draft_memory(draft, kv_dtype, target.dtype, window, ring_size(window, nodes) if window else 0),
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
    decisions = dict(speculative_num_draft_tokens=nodes, speculative_dflash_block_size=block,
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


def token_map_path(flag_value: str | None, draft_dir: str, draft: DraftConfig) -> str | None:
    """The token map the drafter proposes over (read and checked now): --speculative-token-map, else the checkpoint's
    token_map.safetensors, else None (the full vocabulary)."""
    if not flag_value:
        own = os.path.join(draft_dir, TOKEN_MAP_FILE)
        return own if load_token_map(draft_dir, draft.vocab_size) is not None else None
    if not str(flag_value).endswith(".safetensors"):
        _refuse("--speculative-token-map", flag_value, "expected a .safetensors token map (pickle files are never "
                "loaded; `dflash-sglang train --draft-vocab K` writes token_map.safetensors)")
    if not os.path.isfile(flag_value):
        _refuse("--speculative-token-map", flag_value, "no such file")
    read_token_map(flag_value, draft.vocab_size)
    return str(flag_value)


# Draft KV dtypes (SGLang's names) our pool stores: the model dtype, bf16, or fp8 with unit scales (core/draft_kv.py)
DRAFT_KV_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")


def draft_kv_dtype(cfg) -> str:
    """The draft KV pool's dtype name (adapter/versions.py `draft_kv_cache_dtype`: the draft flag, else
    --kv-cache-dtype), one of DRAFT_KV_DTYPES; "auto" = the model dtype."""
    flag, value = draft_kv_cache_dtype(cfg)
    if value not in DRAFT_KV_DTYPES:
        _refuse(flag, value, f"the draft KV pool stores {', '.join(DRAFT_KV_DTYPES)} (block-scaled or fp4 KV not yet)")
    return value


def draft_window(cfg, draft: DraftConfig, block: int, topk: int, graphs: str) -> int:
    """--speculative-draft-window-size W (set): the drafter reads the last W context positions from a ring of rows per
    request slot (adapter/draft_window.py). W >= the block size (SGLang's rule); refused with what addresses the draft
    pool by target KV slot or reads it through req_to_token. cfg: the resolved view; topk: the resolved top-k."""
    flag, value = "--speculative-draft-window-size", cfg.speculative_draft_window_size
    if isinstance(value, bool) or not isinstance(value, int) or value < block:
        _refuse(flag, value, f"must be an integer >= the draft block size ({block})")
    refusals = (
        (not cfg.disable_radix_cache, "a radix-cache hit would find no draft K/V for the cached prefix in the "
         "request's window rows; add --disable-radix-cache"),
        (topk > 1, f"tree verification (top-k {topk}) is not served with a draft window; verify chains "
         "(--speculative-eagle-topk 1)"),
        (disaggregation(cfg) is not None, "PD disaggregation transfers the draft pool by target KV slot"),
        (bool(getattr(cfg, "enable_hierarchical_cache", False)), "HiCache offloads the draft pool by target KV slot"),
        (attention_dp(cfg) is not None, "DP attention is not served with a draft window yet"),
        (draft.dflash2 is not None, "DFlash2 drafters are not served with a draft window yet"),
        (graphs == "static", "the draft CUDA graphs read their key rows through req_to_token: the draft pass runs "
         "eagerly under a window (--speculative-dflash-draft-graphs auto or eager)"),
    )
    for refused, why in refusals:
        if refused:
            _refuse(flag, value, why)
    return value


def draft_graphs(value: str) -> str:
    """--speculative-dflash-draft-graphs (an Engine keyword skips argparse's choices check)."""
    if value not in DRAFT_GRAPHS:
        _refuse("--speculative-dflash-draft-graphs", value, f"expected one of {', '.join(DRAFT_GRAPHS)}")
    return value


def draft_attention(flag_value: str | None, device: str) -> str:
    """--speculative-draft-attention-backend -> our drafter attention: flashinfer (the CUDA default) or torch."""
    if flag_value not in DRAFT_ATTENTION:
        _refuse("--speculative-draft-attention-backend", flag_value, "the drafter attends with flashinfer (CUDA) or "
                "torch_native (any device)")
    choice = DRAFT_ATTENTION[flag_value]
    on_cuda = device.startswith("cuda")
    if choice == "flashinfer" and not on_cuda:
        _refuse("--speculative-draft-attention-backend", flag_value, f"needs a CUDA device, not {device}")
    return choice if choice != "auto" else ("flashinfer" if on_cuda else "torch")


EXPERIMENTAL = "--speculative-dflash-experimental"


def disaggregation(cfg) -> str | None:
    """The PD side this server runs ("prefill" / "decode"), None for a whole server."""
    mode = getattr(cfg, "disaggregation_mode", None)
    return None if mode in (None, "null") else str(mode)


def check_draft_fits(server_args: ServerArgs, cfg: DraftConfig, experimental: bool = False) -> DraftConfig:
    """The draft's config against the target's (and a target we can serve at all); raises CheckpointError.
    Hybrid Gated DeltaNet targets, soft-capped (Gemma 4) drafts and DFlash2 drafts are served with
    `experimental` only, until a GPU end-to-end run validates them."""
    v = view(server_args)
    source = f"{v.speculative_draft_model_path}/config.json"
    hf_config = model_config(server_args).hf_config
    hybrid = recurrent_layers(hf_config)
    if hybrid is not None:
        what = f"--model-path {v.model_path}: the target has recurrent / linear-attention layers ({hybrid})"
        if not gated_deltanet(hf_config):
            raise UnsupportedFlagError(f"{what}; dflash-sglang serves Gated DeltaNet hybrids only (Qwen3.5 / Qwen3.6 / "
                                       f"Qwen3-Next); serve it with {IMPL_ENV}=builtin")
        if not experimental:
            raise UnsupportedFlagError(f"{what}, not yet validated end to end on a GPU with dflash-sglang: pass "
                                       f"{EXPERIMENTAL} to serve it with ours, or set {IMPL_ENV}=builtin")
        if not str(v.device).startswith("cuda"):
            raise UnsupportedFlagError(f"{what}: SGLang's linear-attention kernels run on CUDA only, not --device "
                                       f"{v.device} (core/reference.py is the CPU executable spec)")
    if cfg.dflash2 is not None:
        what = f"{source}: a DFlash2 draft (DFlash2DraftModel: block convolutions and a candidate selector)"
        if not experimental:
            raise UnsupportedFlagError(f"{what} is not yet validated end to end on a GPU with dflash-sglang: pass "
                                       f"{EXPERIMENTAL} to serve it with ours, or set {IMPL_ENV}=builtin")
    if cfg.final_logit_softcapping is not None and not experimental:
        raise UnsupportedFlagError(
            f"{source}: field '{cfg.field_name('final_logit_softcapping')}' (a soft-capped Gemma 4 draft) is not yet "
            f"validated end to end on a GPU with dflash-sglang: pass {EXPERIMENTAL} to serve it with ours, or set "
            f"{IMPL_ENV}=builtin")
    check_fit(cfg, hf_config, draft_source=source)
    if list(cfg.target_layer_ids) != sorted(set(cfg.target_layer_ids)):
        # SGLang captures layer outputs in layer order; the fc input expects them in checkpoint order.
        raise CheckpointError(f"{source}: field 'dflash_config.target_layer_ids' must be strictly increasing")
    return cfg


def running_limits(mode: str, nodes: int, requested: int | None, budget: int | None) -> tuple[int | None, int | None]:
    """(--max-running-requests to declare, the verify token budget per step) of a resolved mode.

    Pinned shapes verify N rows for every running request, so they keep the builtin's default of 48 requests. The
    goodput controller chooses each step's rows from the batch size (plain steps where drafting does not pay), so a
    cap at 48 would only queue requests that plain decoding serves at once: it leaves the cap to SGLang (None), and
    bounds the rows a step verifies by what 48 requests of N rows would (the verify's logits and buffers stay the
    size the builtin's default allows) unless the operator set a budget or the cap."""
    if mode == "goodput" and requested is None:
        return None, budget if budget is not None else DEFAULT_MAX_RUNNING_REQUESTS * nodes
    return (requested if requested is not None else DEFAULT_MAX_RUNNING_REQUESTS), (budget if mode != "chain" else None)


def resolve_shape(server_args: ServerArgs, cfg: DraftConfig, flags: dict, max_running: int | None,
                  simulation: SimulatedAcceptance | None = None) -> tuple[str, int, int, int, str | None]:
    """(mode, B, N, k, adaptive table or None) from the flags (see the module docstring); max_running: the operator's
    --max-running-requests (None: unset)."""
    v = view(server_args)
    topk_flag = v.speculative_eagle_topk
    table, budget = flags["speculative_dflash_adaptive_table"], flags["speculative_dflash_adaptive_token_budget"]
    explicit = v.speculative_num_draft_tokens
    pinned = explicit is not None or v.speculative_dflash_block_size is not None or topk_flag is not None
    if not flags["speculative_adaptive"] and not pinned and table is None and (simulation is None or
                                                                               simulation.serves("goodput")):
        block = draft_block_size(v, cfg)
        check_token_budget(budget, max_running)
        return "goodput", block, block, goodput_topk(server_args, cfg, block, None, simulation), None
    if flags["speculative_adaptive"] and table is None:
        block = draft_block_size(v, cfg)
        nodes = int(explicit) if explicit is not None else block
        if not 2 <= nodes <= block:
            _refuse("--speculative-num-draft-tokens", nodes, f"with --speculative-adaptive it is the most verify "
                    f"rows per request, 2 .. the drafter block ({block})")
        check_token_budget(budget, max_running)
        return "goodput", block, nodes, goodput_topk(server_args, cfg, nodes, topk_flag, simulation), None
    if flags["speculative_adaptive"]:
        if topk_flag is not None:
            _refuse("--speculative-eagle-topk", topk_flag, "with --speculative-adaptive the top-k of each batch size "
                    "comes from --speculative-dflash-adaptive-table; drop the flag")
        block = draft_block_size(v, cfg)
        try:
            _, largest = adaptive_limits(table, budget, block, None if explicit is None else int(explicit),
                                         cfg.vocab_size, max_running or DEFAULT_MAX_RUNNING_REQUESTS)
        except AdaptiveConfigError as e:
            raise UnsupportedFlagError(str(e)) from None
        if largest.topk > 1:
            source = f"--speculative-dflash-adaptive-table {table!r} ({largest.nodes} nodes)"
            if explicit is not None:
                source = f"--speculative-num-draft-tokens {largest.nodes}"
            check_tree_serving(server_args, largest.nodes, source, "tree rows in --speculative-dflash-adaptive-table")
        return "adaptive", block, largest.nodes, largest.topk, table
    given = [flag for flag, name in (("--speculative-dflash-adaptive-table", "speculative_dflash_adaptive_table"),
                                     ("--speculative-dflash-adaptive-token-budget",
                                      "speculative_dflash_adaptive_token_budget"))
             if flags[name] != PLUGIN_DEFAULTS[name]]
    if given:
        _refuse(given[0], "", "needs --speculative-adaptive")
    topk = 1 if topk_flag is None else int(topk_flag)
    if topk < 1:
        _refuse("--speculative-eagle-topk", topk, "must be >= 1 (1: chain, > 1: tree verification)")
    if topk == 1:
        block = chain_block_size(v, cfg)
        return "chain", block, block, 1, None
    block = draft_block_size(v, cfg)
    if topk > cfg.vocab_size:
        _refuse("--speculative-eagle-topk", topk, f"larger than the draft vocabulary ({cfg.vocab_size} tokens)")
    explicit = v.speculative_num_draft_tokens
    nodes = int(explicit if explicit is not None else block)
    most = max_tree_nodes(block - 1, topk)
    if nodes < 2:
        _refuse("--speculative-num-draft-tokens", nodes, "a draft tree needs >= 2 nodes (the root and one draft)")
    if nodes > most:
        _refuse("--speculative-num-draft-tokens", nodes, f"a tree of depth {block - 1} (block size {block}) with "
                f"--speculative-eagle-topk {topk} has at most {most} nodes")
    check_tree_serving(server_args, nodes, f"--speculative-num-draft-tokens {nodes}", "--speculative-eagle-topk > 1")
    return "tree", block, nodes, topk, None


def check_token_budget(budget, max_running: int | None) -> None:
    """--speculative-dflash-adaptive-token-budget for the goodput controller (a static table checks its own);
    max_running None: --max-running-requests unset (SGLang's own cap; a step over more requests than the budget
    runs plain)."""
    flag = "--speculative-dflash-adaptive-token-budget"
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise UnsupportedFlagError(f"{flag} {budget!r}: expected a positive integer (verify tokens per step over the "
                                   f"batch)")
    if budget is not None and max_running is not None and budget < max_running:
        raise UnsupportedFlagError(f"{flag} {budget} is below --max-running-requests {max_running}: every running "
                                   f"request verifies at least one token per step")


def draft_block_size(v, cfg: DraftConfig) -> int:
    """The drafter block B of tree and adaptive modes: --speculative-dflash-block-size, else the checkpoint's."""
    alias = v.speculative_dflash_block_size
    block = int(alias if alias is not None else cfg.block_size)
    if block < 2:
        _refuse("--speculative-dflash-block-size", block, "the draft block size must be >= 2")
    if block > MAX_NODES:
        _refuse("--speculative-dflash-block-size", block, f"at most {MAX_NODES}")
    return block


def chain_block_size(v, cfg: DraftConfig) -> int:
    """The chain's B = N: --speculative-num-draft-tokens or its alias --speculative-dflash-block-size, else the
    checkpoint's."""
    explicit, alias = v.speculative_num_draft_tokens, v.speculative_dflash_block_size
    if alias is not None and explicit is not None and int(alias) != int(explicit):
        raise UnsupportedFlagError(f"--speculative-num-draft-tokens {explicit} and --speculative-dflash-block-size "
                                   f"{alias} differ (both are the DFLASH block size)")
    block = int(explicit if explicit is not None else alias if alias is not None else cfg.block_size)
    if block < 2:
        raise UnsupportedFlagError(f"--speculative-num-draft-tokens {block}: the block size must be >= 2")
    if block > MAX_NODES:
        # A verify of that many rows per request would exhaust memory at warm-up, far from this flag.
        raise UnsupportedFlagError(f"--speculative-num-draft-tokens {block}: at most {MAX_NODES} verify tokens per "
                                   f"request and step (the draft was trained for {cfg.block_size})")
    if block > cfg.block_size:
        logger.warning("DFLASH block size %d is larger than the draft was trained for (%d); acceptance will suffer",
                       block, cfg.block_size)
    return block


def goodput_topk(server_args: ServerArgs, cfg: DraftConfig, nodes: int, topk_flag,
                 simulation: SimulatedAcceptance | None) -> int:
    """The goodput controller's largest tree top-k: 1 under simulated acceptance (it forces chain outcomes), else
    --speculative-eagle-topk when given with --speculative-adaptive (1: chains only; a larger one must be servable),
    else DEFAULT_TREE_TOPK where this server can verify trees (page size 1, a tree-capable attention backend, as far
    as ServerArgs has resolved them; the worker drops trees if what it finds differs), else 1."""
    if simulation is not None:
        return 1
    if topk_flag is not None:
        topk = int(topk_flag)
        if not 1 <= topk <= cfg.vocab_size:
            _refuse("--speculative-eagle-topk", topk, f"with --speculative-adaptive it is the controller's largest "
                    f"tree top-k, 1 (chains only) .. the draft vocabulary ({cfg.vocab_size})")
        if topk > 1:
            check_tree_serving(server_args, nodes, "--speculative-num-draft-tokens",
                               "--speculative-eagle-topk with --speculative-adaptive")
        return topk
    if nodes < 3 or nodes > MAX_NODES or tree_serving_problems(server_args, "goodput trees"):
        return 1
    return min(DEFAULT_TREE_TOPK, cfg.vocab_size)


def check_tree_serving(server_args: ServerArgs, nodes: int, nodes_source: str, tree_source: str) -> None:
    """What tree verification needs of the server: N within the kernels' limit, page size 1, a target attention
    backend that takes the tree mask. nodes_source / tree_source name where N / the tree shapes come from."""
    if nodes > MAX_NODES:
        raise UnsupportedFlagError(f"{nodes_source}: the tree kernels verify at most {MAX_NODES} nodes")
    problems = tree_serving_problems(server_args, tree_source)
    if problems:
        _refuse(*problems[0])


def tree_serving_problems(server_args: ServerArgs, tree_source: str) -> list[tuple[str, object, str]]:
    """(flag, value, why) for each server setting that rules tree verification out (empty: trees can be served)."""
    v = view(server_args)  # what SGLang picked by itself so far (backend and page size for this GPU/model)
    problems = []
    page_size = int(v.page_size or 1)
    if page_size != 1:
        # The accepted path is committed by permuting req_to_token entries, which only a page size of 1 allows.
        problems.append(("--page-size", page_size, f"tree verification ({tree_source}) needs page size 1"
                         + _picked(server_args, v, "page_size")))
    if (window := sliding_window_layers(model_config(server_args).hf_config)) is not None:
        # Tree rows sit at depths, not consecutive positions: a sliding window over them is not what the masks say.
        problems.append(("--model-path", v.model_path, f"tree verification ({tree_source}) needs full attention in "
                         f"every target layer; the target has sliding-window layers ({window})"))
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(v, flag, None)
        if backend is not None and backend not in TREE_ATTENTION_BACKENDS:
            problems.append((f"--{flag.replace('_', '-')}", backend, f"tree verification supports "
                             f"{', '.join(TREE_ATTENTION_BACKENDS)} target attention" + _picked(server_args, v, flag)))
    return problems


def _picked(server_args: ServerArgs, v, field: str) -> str:
    """A hint when the value is SGLang's own choice, not what the user passed."""
    if getattr(server_args, field, None) != getattr(v, field, None):
        return f" (SGLang chose it for this model/GPU; pass --{field.replace('_', '-')} explicitly)"
    return ""


def resolve_draft_path(server_args: ServerArgs) -> None:
    """A hub repo id in --speculative-draft-model-path becomes its local snapshot (declared).

    SGLang's builtin downloads the draft inside its draft model loader; we read the draft's config.json at
    start-up, so the id is resolved here, once, in the process that builds ServerArgs (the scheduler processes
    get the local path). HF_HUB_OFFLINE / HF_HOME / --download-dir / --speculative-draft-model-revision apply.
    """
    cfg = view(server_args)
    path = cfg.speculative_draft_model_path
    if path is None or os.path.isdir(path) or not _looks_like_repo_id(path):
        return  # a local path: DraftConfig.load names what is missing in it
    if os.path.exists(path):
        raise CheckpointError(f"--speculative-draft-model-path {path}: a file; expected a draft directory "
                              f"(config.json + model.safetensors) or a hub repo id")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in ("1", "ON", "YES", "TRUE")
    try:
        local = snapshot_download(path, revision=cfg.speculative_draft_model_revision, cache_dir=cfg.download_dir,
                                  allow_patterns=["*.json", "*.safetensors"], local_files_only=offline)
    except Exception as e:  # hub errors come in many types; the one line must name the flag and the cause
        raise CheckpointError(f"--speculative-draft-model-path {path}: not a local directory, and fetching it as a "
                              f"hub repo failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                              ) from None
    logger.info("DFLASH (dflash-sglang): draft %s -> %s", path, local)
    declare(server_args, SOURCE, speculative_draft_model_path=local)


def _looks_like_repo_id(path: str) -> bool:
    """`name` or `org/name` (what the hub accepts); absolute, ./ ../ ~ and deeper paths are local."""
    return not (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path)
