"""Reduced draft vocabulary (FR-Spec style): the drafter scores K target tokens instead of all V.

A token map is a sorted int64 tensor `[K]` of target token ids, the K most frequent in target-regenerated
text, stored as `token_map.safetensors` (one tensor, `token_map`) next to a draft checkpoint's config.json.
The draft logits are taken against those K rows of the target lm_head (`restrict_head`, [K, H] instead of
[V, H]: the head is most of a small drafter's pass and of its training step) and the proposals are mapped
back to target ids (`to_target_ids`). Verification is unchanged, so decoding stays lossless under greedy and
sampling alike; a token outside the map can never be drafted, so a position whose target token is outside
ends the accepted chain there. A checkpoint without the file (every z-lab checkpoint) drafts over the full
vocabulary.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .config import CheckpointError

TOKEN_MAP_FILE = "token_map.safetensors"
TOKEN_MAP_TENSOR = "token_map"


def token_counts(sequences: Iterable[Tensor], vocab_size: int) -> Tensor:
    """How often each target token occurs in `sequences` (each [T] int64 ids) -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.long().flatten(), minlength=vocab_size)[:vocab_size]
    return counts


def build_token_map(counts: Tensor, k: int) -> Tensor:
    """counts [V] int64 -> the K most frequent token ids, sorted ascending, [K] int64.

    Ties go to the lower id (a stable sort on -count), so the same counts always give the same map.
    """
    vocab = counts.numel()
    if not 1 <= k <= vocab:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab}] (the target vocabulary), got {k}")
    order = torch.sort(-counts.long(), stable=True).indices
    return order[:k].sort().values


def check_token_map(token_map: Tensor, vocab_size: int, source: str) -> Tensor:
    """Validate a token map against the target vocabulary; raises CheckpointError naming `source` and the field."""
    field = f"tensor '{TOKEN_MAP_TENSOR}'"
    if token_map.dtype != torch.int64:
        raise CheckpointError(f"{source}: {field} must be int64, got {token_map.dtype}")
    if token_map.dim() != 1 or token_map.numel() == 0:
        raise CheckpointError(f"{source}: {field} must be a non-empty 1-D list of token ids, got shape "
                              f"{list(token_map.shape)}")
    lo, hi = int(token_map.min()), int(token_map.max())
    if lo < 0 or hi >= vocab_size:
        raise CheckpointError(f"{source}: {field} has ids outside the target vocabulary [0, {vocab_size}): "
                              f"min {lo}, max {hi}")
    if token_map.numel() > 1 and not bool((token_map[1:] > token_map[:-1]).all()):
        raise CheckpointError(f"{source}: {field} must be strictly increasing (sorted, no duplicates)")
    return token_map


def load_token_map(draft_dir: str | Path, vocab_size: int) -> Tensor | None:
    """The map next to a draft checkpoint ([K] int64), or None when the checkpoint has none (full vocabulary)."""
    path = Path(draft_dir) / TOKEN_MAP_FILE
    return read_token_map(path, vocab_size) if path.is_file() else None


def read_token_map(path: str | Path, vocab_size: int) -> Tensor:
    """A token map file ([K] int64, checked against the draft's vocabulary); raises CheckpointError naming it."""
    path = Path(path)
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated/garbled headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    with handle:
        names = list(handle.keys())
        if names != [TOKEN_MAP_TENSOR]:
            raise CheckpointError(f"{path}: expected exactly one tensor '{TOKEN_MAP_TENSOR}', found {names}")
        token_map = handle.get_tensor(TOKEN_MAP_TENSOR)
    return check_token_map(token_map, vocab_size, str(path))


def save_token_map(token_map: Tensor | None, out_dir: str | Path) -> Path | None:
    """Write the map next to a checkpoint; None removes a stale one (a full-vocabulary export into a directory
    that held a reduced drafter must not keep its old map)."""
    path = Path(out_dir) / TOKEN_MAP_FILE
    if token_map is None:
        path.unlink(missing_ok=True)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({TOKEN_MAP_TENSOR: token_map.detach().to("cpu", torch.int64).contiguous()}, str(path),
              metadata={"format": "pt"})
    return path


def restrict_head(lm_head_weight: Tensor, token_map: Tensor | None) -> Tensor:
    """lm_head_weight [V, H] -> the draft head [K, H] (a contiguous copy, taken once, not per step); the whole
    weight without a map."""
    if token_map is None:
        return lm_head_weight
    return lm_head_weight.index_select(0, token_map.to(lm_head_weight.device)).contiguous()


def to_target_ids(draft_ids: Tensor, token_map: Tensor | None) -> Tensor:
    """draft_ids [...] int64 in [0, K) (rows of the draft head) -> target token ids [...] int64."""
    if token_map is None:
        return draft_ids
    return token_map.to(draft_ids.device)[draft_ids]


def inverse_map(token_map: Tensor, vocab_size: int) -> Tensor:
    """[V] int64: the draft row of each target token, -1 for tokens outside the map (training labels)."""
    inv = torch.full((vocab_size,), -1, dtype=torch.long, device=token_map.device)
    inv[token_map] = torch.arange(token_map.numel(), device=token_map.device)
    return inv
