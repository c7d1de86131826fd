"""The draft checkpoint and the draft-side flags, checked at start-up: where the draft is (a hub id fetched once),
whether it fits the target (and a target we serve at all), its token map, the draft window, the draft graphs mode and
the drafter's attention backend. Each error is one line naming the flag, file or field.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_sglang.core.draft.checkpoint import check_fit
from dflash_sglang.core.draft.config import CheckpointError, DraftConfig, gated_deltanet, recurrent_layers
from dflash_sglang.core.draft.token_map import TOKEN_MAP_FILE, load_token_map, read_token_map

from ..draft.attention import FlashInferPagedAttention
from ..settings import DRAFT_ATTENTION, DRAFT_GRAPHS, IMPL_ENV, UnsupportedFlagError
from ..versions import attention_dp, declare, model_config, view
from .refusals import EXPERIMENTAL, disaggregation, refuse

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
SOURCE = "dflash_sglang"  # the source named in SGLang's declarations


def token_map_path(flag_value: str | None, draft_dir: str, draft: DraftConfig) -> str | None:
    """The token map the drafter proposes over (read and checked now): --speculative-token-map, else the checkpoint's
    token_map.safetensors, else None (the full vocabulary)."""
    if not flag_value:
        own = os.path.join(draft_dir, TOKEN_MAP_FILE)
        return own if load_token_map(draft_dir, draft.vocab_size) is not None else None
    if not str(flag_value).endswith(".safetensors"):
        refuse("--speculative-token-map", flag_value, "expected a .safetensors token map (pickle files are never "
                "loaded; `dflash-sglang train --draft-vocab K` writes token_map.safetensors)")
    if not os.path.isfile(flag_value):
        refuse("--speculative-token-map", flag_value, "no such file")
    read_token_map(flag_value, draft.vocab_size)
    return str(flag_value)


@dataclass(frozen=True)
class WindowLayout:
    """How `--speculative-draft-window-size W` is served (adapter/draft/context_rows.py): the slot rows (one per target
    KV slot) read over the last W positions, or a ring of W + N - 1 rows per request slot; `why`: the reason, said in
    the start-up line."""

    window: int
    ring: bool
    why: str
    topk: int  # the resolved top-k (the goodput controller's trees left out for the ring)


def draft_window(cfg, draft: DraftConfig, mode: str, block: int, topk: int, attention: str) -> WindowLayout:
    """--speculative-draft-window-size W (set): W >= the draft block size (SGLang's rule), and the layout. The ring
    wherever it serves (its memory is the point with the radix cache off); the slot rows wherever the server needs a
    draft row at each target KV slot, or reads the pool through req_to_token: then the window bounds the reads only.
    The goodput controller's trees (no --speculative-eagle-topk) are left out for the ring: its shapes are then chains.
    cfg: the resolved view; mode, block, topk: the resolved shape; attention: the resolved drafter attention
    ("flashinfer" / "torch")."""
    flag, value = "--speculative-draft-window-size", cfg.speculative_draft_window_size
    if isinstance(value, bool) or not isinstance(value, int) or value < block:
        refuse(flag, value, f"must be an integer >= the draft block size ({block})")
    kinds = {draft.layer_kind(i) for i in range(draft.num_hidden_layers)}
    dense = attention == "flashinfer" and not all(FlashInferPagedAttention.expresses(k, block) for k in kinds)
    trees = topk > 1 and (mode != "goodput" or cfg.speculative_eagle_topk is not None)
    slot_rows = (  # (needs the slot rows, why), first match said
        (not cfg.disable_radix_cache, "the radix cache is on: a cached prefix's draft rows stay at its KV slots"),
        (disaggregation(cfg) is not None, "PD disaggregation transfers the draft rows by target KV slot"),
        (bool(getattr(cfg, "enable_hierarchical_cache", False)), "HiCache offloads the draft rows by target KV slot"),
        (attention_dp(cfg) is not None, "DP attention: its groups' request slots are not sized for rings"),
        (trees, f"tree verification (top-k {topk}): a tree's nodes share positions, by which a ring is indexed"),
        (dense, "the drafter's dense attention path (a bidirectional sliding window narrower than the block on "
         "FlashInfer) reads the draft rows by target KV slot"),
    )
    why = next((why for needed, why in slot_rows if needed), None)
    if why is not None:
        return WindowLayout(value, False, why, topk)
    return WindowLayout(value, True, "the radix cache is off: a ring per request slot", 1)


def draft_graphs(value: str) -> str:
    """--speculative-dflash-draft-graphs (an Engine keyword skips argparse's choices check)."""
    if value not in DRAFT_GRAPHS:
        refuse("--speculative-dflash-draft-graphs", value, f"expected one of {', '.join(DRAFT_GRAPHS)}")
    return value


def draft_attention(flag_value: str | None, device: str) -> str:
    """--speculative-draft-attention-backend -> our drafter attention: flashinfer (the CUDA default) or torch."""
    if flag_value not in DRAFT_ATTENTION:
        refuse("--speculative-draft-attention-backend", flag_value, "the drafter attends with flashinfer (CUDA) or "
                "torch_native (any device)")
    choice = DRAFT_ATTENTION[flag_value]
    on_cuda = device.startswith("cuda")
    if choice == "flashinfer" and not on_cuda:
        refuse("--speculative-draft-attention-backend", flag_value, f"needs a CUDA device, not {device}")
    return choice if choice != "auto" else ("flashinfer" if on_cuda else "torch")


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
