"""Server-arg resolution for `--speculative-algorithm DFLASH` when dflash_sglang serves it.

Replaces SGLang's `_handle_dflash` (which refuses CPU). Runs in the process that builds ServerArgs,
before any scheduler starts, so every startup error is one line naming the flag or file:

- flags this adapter does not support yet (tp/pp/dp > 1, DP attention, draft window) are refused;
- a hub repo id as the draft is fetched to its local snapshot (`resolve_draft_path`), then the draft
  checkpoint is parsed and checked against the target config (`CheckpointError` names the file and field);
- on CUDA the GPU-only dependency (flashinfer) must be importable and nvcc findable (our kernels are built at
  worker start-up); PD disaggregation, HiCache and quantized KV are refused (no transferable draft KV pool yet);
- tree checks read the values SGLang picked itself (attention backend, page size), not only the flags.

`precheck` runs before SGLang's generic speculative handling, `handle_dflash_args` replaces `_handle_dflash`.

Flag mapping (`SpecFlags`):
- chain (`--speculative-eagle-topk` 1, the default): block size B = `--speculative-num-draft-tokens` (alias
  `--speculative-dflash-block-size`), default the checkpoint's `block_size`; N = B tokens verified per step.
- tree (`--speculative-eagle-topk k`, k > 1): the drafter block B = `--speculative-dflash-block-size`, default
  the checkpoint's `block_size`; N = `--speculative-num-draft-tokens` (default B) tree nodes verified per step,
  root (bonus token) included, best-first over the top-k of each of the B-1 draft positions.
- adaptive (`DFLASH_ADAPTIVE=1`, adapter/adaptive.py): B as for a tree; each step's shape comes from
  `DFLASH_ADAPTIVE_TABLE` by batch size; N = the largest shape it can pick (or the explicit
  `--speculative-num-draft-tokens`, which every row must fit), k = its largest top-k; `--speculative-eagle-topk`
  is refused (the table picks it).
Resolved values are written back (`speculative_num_draft_tokens` = N, `speculative_dflash_block_size` = B,
`speculative_eagle_topk` = k, `speculative_num_steps` = 1): SGLang sizes its per-step KV reservation from N
(`DFlashDraftInputV2.prepare_for_decode` reserves 2*N slots past the committed length), which is what a
step writes: N verify rows at `seq_len + node index`.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_sglang.core.checkpoint import check_fit
from dflash_sglang.core.config import CheckpointError, DraftConfig
from dflash_sglang.core.tree import max_tree_nodes
from dflash_sglang.ops import MAX_NODES, find_nvcc

from .adaptive import ENV_SWITCH, ENV_TABLE, AdaptiveEnv, adaptive_limits

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEVICES = ("cuda", "cpu")
DEFAULT_MAX_RUNNING_REQUESTS = 48  # same default as SGLang's builtin DFLASH
# Target attention backends that take the tree mask: torch_native through adapter/tree_attention.py, the GPU
# ones through the verify input's `custom_mask` (the layout EAGLE's tree verify uses).
TREE_ATTENTION_BACKENDS = ("torch_native", "flashinfer", "triton")


class UnsupportedFlagError(ValueError):
    """A server flag (or flag combination) that dflash_sglang's DFLASH does not support yet."""


def _refuse(flag: str, value, why: str) -> None:
    shown = f"{flag} {value}" if value != "" else flag
    raise UnsupportedFlagError(
        f"{shown}: {why} (dflash-sglang DFLASH; set DFLASH_SGLANG_IMPL=builtin for SGLang's own)"
    )


def check_supported_flags(server_args: ServerArgs) -> None:
    device = str(server_args.device)
    if device.split(":")[0] not in DEVICES:
        _refuse("--device", device, f"only {' and '.join(DEVICES)} are supported")
    for flag, name in (("--tp-size", "tp_size"), ("--pp-size", "pp_size"), ("--dp-size", "dp_size")):
        value = int(getattr(server_args, name, 1) or 1)
        if value != 1:
            _refuse(flag, value, "only 1 is supported yet")
    if getattr(server_args, "enable_dp_attention", False):
        _refuse("--enable-dp-attention", "", "DP attention is not supported yet")
    if getattr(server_args, "speculative_adaptive", False):
        raise UnsupportedFlagError(
            f"--speculative-adaptive: SGLang's adaptive mode is EAGLE-only; DFLASH picks its shape per step from the "
            f"batch size with {ENV_SWITCH}=1 (see docs/sglang.md)"
        )
    if server_args.speculative_draft_window_size is not None:
        _refuse("--speculative-draft-window-size", server_args.speculative_draft_window_size, "not supported yet")
    if server_args.speculative_draft_model_path is None:
        raise UnsupportedFlagError("--speculative-algorithm DFLASH needs --speculative-draft-model-path DIR")
    if device.startswith("cuda"):
        if importlib.util.find_spec("flashinfer") is None:
            raise ImportError("--device cuda: DFLASH needs the GPU-only package flashinfer "
                              "(pip install flashinfer-python)")
        try:
            find_nvcc()  # our kernels are built at worker start-up (cached); a missing compiler fails here, not mid-run
        except RuntimeError as e:
            raise UnsupportedFlagError(f"--device cuda: {e}") from None
    for flag, name, ok in (("--disaggregation-mode", "disaggregation_mode", (None, "null")),
                           ("--enable-hierarchical-cache", "enable_hierarchical_cache", (None, False))):
        value = getattr(server_args, name, None)
        if value not in ok:
            # We expose no draft KV pool to transfer or offload: the draft KV would go stale (lossless, but tau drops).
            _refuse(flag, "" if value is True else value, "the draft KV pool cannot be transferred or offloaded yet")
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto") or "auto")
    if kv_dtype not in ("auto", "bfloat16", "float16", "float32"):
        _refuse("--kv-cache-dtype", kv_dtype, "the draft KV pool is kept in the model dtype (quantized KV not yet)")


def load_draft_config(server_args: ServerArgs) -> DraftConfig:
    """Parse the draft's config.json and check it against the target's config; raises CheckpointError."""
    draft_dir = server_args.speculative_draft_model_path
    source = f"{draft_dir}/config.json"
    cfg = DraftConfig.load(draft_dir)
    check_fit(cfg, server_args.get_model_config().hf_config, draft_source=source)
    if list(cfg.target_layer_ids) != sorted(set(cfg.target_layer_ids)):
        # SGLang captures layer outputs in layer order; the fc input expects them in checkpoint order.
        raise CheckpointError(f"{source}: field 'dflash_config.target_layer_ids' must be strictly increasing")
    return cfg


@dataclass(frozen=True)
class SpecFlags:
    """The per-step speculation shape resolved from the server flags (see the module docstring)."""

    block_size: int  # B: drafter block [bonus, MASK x (B-1)], one drafter pass per step
    nodes: int  # N: verify rows per request and step, root included (the chain: N == B)
    topk: int  # k: draft candidates per block position (1: chain)

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @classmethod
    def from_server_args(cls, server_args: ServerArgs) -> SpecFlags:
        """The values `handle_dflash_args` wrote back (read in the scheduler process)."""
        nodes = int(server_args.speculative_num_draft_tokens)
        block = server_args.speculative_dflash_block_size
        return cls(int(block) if block is not None else nodes, nodes, int(server_args.speculative_eagle_topk or 1))


def resolve_spec_flags(server_args: ServerArgs, cfg: DraftConfig) -> SpecFlags:
    adaptive = AdaptiveEnv.read()
    if adaptive is not None:
        return resolve_adaptive_flags(server_args, cfg, adaptive)
    topk = 1 if server_args.speculative_eagle_topk is None else int(server_args.speculative_eagle_topk)
    if topk < 1:
        _refuse("--speculative-eagle-topk", topk, "must be >= 1 (1: chain, > 1: tree verification)")
    if topk == 1:
        block = resolve_block_size(server_args, cfg)
        return SpecFlags(block, block, 1)
    return resolve_tree_flags(server_args, cfg, topk)


def resolve_tree_flags(server_args: ServerArgs, cfg: DraftConfig, topk: int) -> SpecFlags:
    """Tree mode: B from the block-size flag (or the checkpoint), N from --speculative-num-draft-tokens."""
    block = draft_block_size(server_args, cfg)
    if topk > cfg.vocab_size:
        _refuse("--speculative-eagle-topk", topk, f"larger than the draft vocabulary ({cfg.vocab_size} tokens)")
    explicit = server_args.speculative_num_draft_tokens
    nodes = int(explicit if explicit is not None else block)
    most = max_tree_nodes(block - 1, topk)
    if nodes < 2:
        _refuse("--speculative-num-draft-tokens", nodes, "a draft tree needs >= 2 nodes (the root and one draft)")
    if nodes > most:
        _refuse("--speculative-num-draft-tokens", nodes, f"a tree of depth {block - 1} (block size {block}) with "
                f"--speculative-eagle-topk {topk} has at most {most} nodes")
    check_tree_serving(server_args, nodes, f"--speculative-num-draft-tokens {nodes}", "--speculative-eagle-topk > 1")
    return SpecFlags(block, nodes, topk)


def resolve_adaptive_flags(server_args: ServerArgs, cfg: DraftConfig, settings: AdaptiveEnv) -> SpecFlags:
    """DFLASH_ADAPTIVE=1: B as for a tree, N = the largest shape the table can pick (or the explicit flag, which
    every row must fit), k = the largest top-k; the tree constraints apply when any row is a tree."""
    if server_args.speculative_eagle_topk is not None:
        _refuse("--speculative-eagle-topk", server_args.speculative_eagle_topk,
                f"with {ENV_SWITCH}=1 the top-k of each batch size comes from {ENV_TABLE}; drop the flag")
    block = draft_block_size(server_args, cfg)
    explicit = server_args.speculative_num_draft_tokens
    _, largest = adaptive_limits(settings, block, None if explicit is None else int(explicit), cfg.vocab_size,
                                 server_args.max_running_requests)
    if largest.topk > 1:
        source = f"{ENV_TABLE}={settings.table!r} ({largest.nodes} nodes)"
        if explicit is not None:
            source = f"--speculative-num-draft-tokens {largest.nodes}"
        check_tree_serving(server_args, largest.nodes, source, f"tree rows in {ENV_TABLE}")
    return SpecFlags(block, largest.nodes, largest.topk)


def draft_block_size(server_args: ServerArgs, cfg: DraftConfig) -> int:
    """The drafter block B of tree and adaptive modes: --speculative-dflash-block-size, else the checkpoint's."""
    alias = server_args.speculative_dflash_block_size
    block = int(alias if alias is not None else cfg.block_size)
    if block < 2:
        _refuse("--speculative-dflash-block-size", block, "the draft block size must be >= 2")
    return block


def check_tree_serving(server_args: ServerArgs, nodes: int, nodes_source: str, tree_source: str) -> None:
    """What tree verification needs of the server: N within the kernels' limit, page size 1, a target attention
    backend that takes the tree mask. nodes_source / tree_source name where N / the tree shapes come from."""
    if nodes > MAX_NODES:
        raise UnsupportedFlagError(f"{nodes_source}: the tree kernels verify at most {MAX_NODES} nodes")
    view = resolved(server_args)  # what SGLang picked by itself so far (backend and page size for this GPU/model)
    page_size = int(view.page_size or 1)
    if page_size != 1:
        # The accepted path is committed by permuting req_to_token entries, which only a page size of 1 allows.
        _refuse("--page-size", page_size, f"tree verification ({tree_source}) needs page size 1"
                + _picked(server_args, view, "page_size"))
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(view, flag, None)
        if backend is not None and backend not in TREE_ATTENTION_BACKENDS:
            _refuse(f"--{flag.replace('_', '-')}", backend, f"tree verification supports "
                    f"{', '.join(TREE_ATTENTION_BACKENDS)} target attention" + _picked(server_args, view, flag))


def resolved(server_args: ServerArgs):
    """ServerArgs as resolved so far: SGLang 0.5.17 stashes its own choices (the attention backend for the GPU,
    the page size) as declarations it applies only at the end of resolution, after our hooks ran."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view
    except ImportError:
        return server_args
    return resolved_view(server_args)


def _picked(server_args: ServerArgs, view, field: str) -> str:
    """A hint when the value is SGLang's own choice, not what the user passed."""
    if getattr(server_args, field, None) != getattr(view, field, None):
        return f" (SGLang chose it for this model/GPU; pass --{field.replace('_', '-')} explicitly)"
    return ""


def resolve_block_size(server_args: ServerArgs, cfg: DraftConfig) -> int:
    explicit = server_args.speculative_num_draft_tokens
    alias = server_args.speculative_dflash_block_size
    if alias is not None and explicit is not None and int(alias) != int(explicit):
        raise UnsupportedFlagError(
            f"--speculative-num-draft-tokens {explicit} and --speculative-dflash-block-size {alias} differ "
            f"(both are the DFLASH block size)"
        )
    block = int(explicit if explicit is not None else alias if alias is not None else cfg.block_size)
    if block < 2:
        raise UnsupportedFlagError(f"--speculative-num-draft-tokens {block}: the block size must be >= 2")
    if block > cfg.block_size:
        logger.warning(
            "DFLASH block size %d is larger than the draft was trained for (%d); acceptance will suffer",
            block, cfg.block_size,
        )
    return block


def resolve_draft_path(server_args: ServerArgs) -> None:
    """A hub repo id in --speculative-draft-model-path becomes its local snapshot, in place.

    SGLang's builtin downloads the draft inside its draft model loader; we read the draft's config.json at
    start-up, so the id is resolved here, once, in the process that builds ServerArgs (the scheduler processes
    get the local path). HF_HUB_OFFLINE / HF_HOME / --download-dir / --speculative-draft-model-revision apply.
    """
    path = server_args.speculative_draft_model_path
    if path is None or os.path.isdir(path) or not _looks_like_repo_id(path):
        return  # a local path: DraftConfig.load names what is missing in it
    if os.path.exists(path):
        raise CheckpointError(f"--speculative-draft-model-path {path}: a file; expected a draft directory "
                              f"(config.json + model.safetensors) or a hub repo id")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in ("1", "ON", "YES", "TRUE")
    try:
        local = snapshot_download(path, revision=server_args.speculative_draft_model_revision,
                                  cache_dir=server_args.download_dir, allow_patterns=["*.json", "*.safetensors"],
                                  local_files_only=offline)
    except Exception as e:  # hub errors come in many types; the one line must name the flag and the cause
        raise CheckpointError(f"--speculative-draft-model-path {path}: not a local directory, and fetching it as a "
                              f"hub repo failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                              ) from None
    logger.info("DFLASH (dflash-sglang): draft %s -> %s", path, local)
    server_args.speculative_draft_model_path = local


def _looks_like_repo_id(path: str) -> bool:
    """`name` or `org/name` (what the hub accepts); absolute, ./ ../ ~ and deeper paths are local."""
    return not (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path)


def precheck(server_args: ServerArgs) -> None:
    """Before SGLang's own speculative-arg handling: refuse unsupported flags, fetch a hub draft, and fail on an
    unreadable draft config with one line."""
    check_supported_flags(server_args)
    resolve_draft_path(server_args)
    DraftConfig.load(server_args.speculative_draft_model_path)


def handle_dflash_args(server_args: ServerArgs) -> None:
    """In-place resolution of DFLASH server args (the AROUND hook on `_handle_dflash` calls this)."""
    check_supported_flags(server_args)
    cfg = load_draft_config(server_args)
    if server_args.max_running_requests is None:  # before the flags: the adaptive token budget is checked against it
        server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
    flags = resolve_spec_flags(server_args, cfg)
    # SGLang's KV reservation and buffer sizing read num_draft_tokens (N verify rows per step, the most any
    # adaptive step verifies) and num_steps.
    server_args.speculative_num_draft_tokens = flags.nodes
    server_args.speculative_dflash_block_size = flags.block_size
    server_args.speculative_eagle_topk = flags.topk
    server_args.speculative_num_steps = 1
    draft_backend = getattr(server_args, "speculative_draft_attention_backend", None)
    if draft_backend not in (None, "flashinfer") and str(server_args.device) != "cpu":
        logger.warning("DFLASH (dflash-sglang): --speculative-draft-attention-backend %s is not used: the drafter "
                       "attends with FlashInfer (DFLASH_DRAFT_ATTENTION=torch for the torch reference)", draft_backend)
    if server_args.enable_mixed_chunk:
        server_args.enable_mixed_chunk = False
        logger.warning("DFLASH: --enable-mixed-chunk is turned off (decode and prefill run as separate batches)")
    if str(server_args.device) == "cpu" and not server_args.disable_overlap_schedule:
        # SGLang has no overlap scheduler for speculative decoding on CPU; run the worker synchronously.
        server_args.disable_overlap_schedule = True
