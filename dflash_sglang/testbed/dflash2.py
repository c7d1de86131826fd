"""A DFlash2 draft derived from a DFlash draft, for tests and benchmarks where no DFlash2 checkpoint fits the target.

The published DFlash2 drafts belong to 27-30B targets; the CPU testbed needs one for its SmolLM2 target (and the e2e
tests for their tiny one). Derived: the DFlash draft's layers unchanged, each sublayer inside a block convolution near
the identity (core/draft/conv.py), and a candidate selector (core/draft/selector.py) whose small random pair term
reorders its candidates now and then. It drafts about as well as the DFlash draft it came from, and runs every DFlash2
code path (the convolutions, the selector's walk, its q, its trees) at the shapes of a real one; a random DFlash2 draft
is accepted so rarely that a goodput controller rightly stops drafting with it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dflash_sglang.core.draft.checkpoint import load_drafter, save_drafter
from dflash_sglang.core.draft.config import DFlash2Fields
from dflash_sglang.core.draft.drafter import DFlashDrafter

# Perturbation sizes, independent of the hidden size H and selector rank r: convolution taps and their dynamic
# coefficients ~0.05 around the identity, a selector pair term ~0.5 logits (codebooks N(0, 1): W entries 0.5/sqrt(H r))
CONV_NOISE, PAIR_LOGITS = 0.05, 0.5


def derive_dflash2(draft_dir: str | Path, out_dir: str | Path, fields: DFlash2Fields, seed: int = 3,
                   dtype: torch.dtype = torch.float32, **config: Any) -> Path:
    """Write the DFlash2 draft derived from the DFlash draft at `draft_dir` (fields: its convolution and selector
    settings) to `out_dir`; returns `out_dir`. config: other DraftConfig fields to set, e.g. `layer_types`,
    `sliding_window` and `is_causal` for sliding-window layers as the published drafts have (same weights)."""
    dflash = load_drafter(draft_dir, dtype=torch.float32)
    if dflash.cfg.dflash2 is not None:
        raise ValueError(f"{draft_dir}: already a DFlash2 draft")
    torch.manual_seed(seed)
    drafter = DFlashDrafter(replace(dflash.cfg, dflash2=fields, **config))
    unexpected = drafter.load_state_dict(dflash.state_dict(), strict=False).unexpected_keys
    assert not unexpected, unexpected
    hidden, rank = drafter.cfg.hidden_size, fields.selector_rank
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("base_kernel"):
                p.add_(torch.randn_like(p) * CONV_NOISE)
            elif name.endswith("kernel_projection.weight"):
                p.normal_(0, CONV_NOISE / hidden**0.5)
            elif name.endswith("hidden_projection.weight"):
                p.normal_(0, PAIR_LOGITS / (hidden * rank) ** 0.5)
    if dflash.token_map is not None:
        drafter.token_map = dflash.token_map
    return save_drafter(drafter.eval(), out_dir, dtype=dtype)
