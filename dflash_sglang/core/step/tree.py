"""Draft trees from one DFlash pass (the reference for the `build_tree` CUDA op).

One drafter pass gives, for block positions 1..D (D = B-1), the top-K candidate tokens and their log-probs.
Their product is a lattice: a node at depth d (carrying one of the K candidates of position d) has K
children at depth d+1. `build_tree` keeps the N-1 best lattice nodes under the root (the bonus token),
best-first by path score = sum of log-probs along the path (DDTree). Ties break deterministically by
depth ascending, then by the path's candidate ranks compared lexicographically. Because a node only becomes
a candidate once its parent is taken, the tree is prefix-closed, and node ids follow selection order, so a
parent always precedes its children. The chain is K = 1 with N = B.

`grow_tree` is the same best-first search with each node's children given by a function of the node (DFlash2's
selector scores a node's children with the node's own token as predecessor, core/draft/selector.py); `build_tree` is it
with every node at depth d offered position d+1's top-K.

Verification of the tree lives in core/step/tree_verify.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

_KEY_LIMIT = 2**63  # path keys are base-K integers of D digits held in int64


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, N nodes each; node 0 is the root (the bonus token, depth 0)."""

    tokens: Tensor  # [bs, N] int64 — node token (root: the bonus token)
    parent: Tensor  # [bs, N] int64 — parent node id, -1 for the root; parent[i] < i
    depth: Tensor  # [bs, N] int64 — 0 for the root; verify position = seq_len + depth
    score: Tensor  # [bs, N] float32 — cumulative draft log-prob of the path (root: 0)
    mask: Tensor  # [bs, N, N] bool — mask[b, i, j]: node i attends to node j (ancestor or itself)
    # SGLang's EAGLE verify ABI (verify_tree_greedy / tree_speculative_sampling_target_only):
    retrive_index: Tensor  # [bs, N] int64 — b * N + i, the node's row in the flattened verify batch
    retrive_next_token: Tensor  # [bs, N] int64 — first child (lowest node id), -1 for leaves
    retrive_next_sibling: Tensor  # [bs, N] int64 — next sibling in node order, -1 for the last one
    max_depth: int  # D: depth bound of the lattice; verify outputs are [bs, D + 1]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def max_tree_nodes(depth: int, k: int) -> int:
    """Number of lattice nodes including the root: 1 + K + K^2 + ... + K^D."""
    return 1 + sum(k**d for d in range(1, depth + 1))


def check_tree_args(root: Tensor, topk_tokens: Tensor, topk_logp: Tensor, num_nodes: int) -> tuple[int, int, int]:
    """Shape checks shared by the reference and the kernel wrapper; returns (bs, D, K)."""
    if topk_tokens.dim() != 3 or topk_tokens.shape != topk_logp.shape:
        raise ValueError(
            f"topk_tokens {tuple(topk_tokens.shape)} and topk_logp {tuple(topk_logp.shape)} must both be [bs, D, K]"
        )
    bs, depth, k = topk_tokens.shape
    if root.shape != (bs,):
        raise ValueError(f"root must be [bs]=[{bs}], got {tuple(root.shape)}")
    if depth < 1 or k < 1:
        raise ValueError(f"need D >= 1 draft positions and K >= 1 candidates, got D={depth} K={k}")
    if k**depth >= _KEY_LIMIT:
        raise ValueError(f"K**D must be < 2**63 for the tie-break path key, got K={k} D={depth}")
    if not 1 <= num_nodes <= max_tree_nodes(depth, k):
        raise ValueError(f"num_nodes must be in [1, {max_tree_nodes(depth, k)}] for D={depth} K={k}, got {num_nodes}")
    return bs, depth, k


def build_tree(root: Tensor, topk_tokens: Tensor, topk_logp: Tensor, num_nodes: int) -> DraftTree:
    """Best-first draft tree of `num_nodes` nodes from one DFlash pass.

    root        [bs] int64 — the bonus token (node 0)
    topk_tokens [bs, D, K] int64 — candidates for block positions 1..D (index d-1 holds position d)
    topk_logp   [bs, D, K] float32 — their log-probs (<= 0; -inf allowed)
    num_nodes   N, 1 <= N <= 1 + K + ... + K^D
    """
    bs, depth_max, k = check_tree_args(root, topk_tokens, topk_logp, num_nodes)
    if topk_logp.dtype != torch.float32:
        raise ValueError(f"topk_logp must be float32, got {topk_logp.dtype}")
    if bool(torch.isnan(topk_logp).any()) or bool((topk_logp > 0).any()):
        raise ValueError("topk_logp must hold log-probabilities: no NaN, all <= 0")
    rows = torch.arange(bs, device=root.device)

    def children(token: Tensor, depth: Tensor) -> tuple[Tensor, Tensor]:
        at = depth.clamp_max(depth_max - 1)  # (a node at depth D has no children; its row is never used)
        return topk_tokens[rows, at], topk_logp[rows, at]

    return grow_tree(root, children, depth_max, k, num_nodes)


Children = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def grow_tree(root: Tensor, children: Children, depth_max: int, k: int, num_nodes: int) -> DraftTree:
    """Best-first draft tree of `num_nodes` nodes whose children come from `children`.

    root      [bs] int64 — the bonus token (node 0)
    children  (token [bs] int64, depth [bs] int64) of a node -> (tokens [bs, K] int64, logp [bs, K] float32): its K
              children at depth + 1, best first (the rank breaks ties), with their log-probs given the node
    depth_max D, the deepest a node may sit; num_nodes N, 1 <= N <= 1 + K + ... + K^D
    """
    bs, n_max, dev = root.shape[0], num_nodes, root.device
    assert 1 <= n_max <= max_tree_nodes(depth_max, k) and k**depth_max < _KEY_LIMIT, "checked by the caller"
    rows = torch.arange(bs, device=dev)
    tokens = torch.full((bs, n_max), -1, dtype=torch.int64, device=dev)
    parent = torch.full_like(tokens, -1)
    depth = torch.zeros_like(tokens)
    key = torch.zeros_like(tokens)  # base-K digits = candidate ranks along the path
    score = torch.zeros(bs, n_max, dtype=torch.float32, device=dev)
    child_tokens = torch.zeros(bs, n_max, k, dtype=torch.int64, device=dev)  # node s's K children
    child_logp = torch.zeros(bs, n_max, k, dtype=torch.float32, device=dev)
    taken = torch.zeros(bs, n_max, k, dtype=torch.bool, device=dev)  # lattice child (s, r) already a node
    mask = torch.zeros(bs, n_max, n_max, dtype=torch.bool, device=dev)
    tokens[:, 0] = root
    mask[:, 0, 0] = True
    child_tokens[:, 0], child_logp[:, 0] = children(root, depth[:, 0])
    ranks = torch.arange(k, device=dev)
    for n in range(1, n_max):
        # Candidates are the K lattice children (s, r) of every node s < n; one is taken per step.
        d = depth[:, :n]
        valid = (d < depth_max)[..., None] & ~taken[:, :n]
        cand_score = score[:, :n, None] + child_logp[:, :n]  # float32 adds
        cand_depth = (d + 1)[..., None].expand(-1, -1, k)
        cand_key = key[:, :n, None] * k + ranks
        best = _lexi_best(valid, (cand_score, True), (cand_depth, False), (cand_key, False)).flatten(1)
        flat = best.int().argmax(1)  # exactly one winner per row: keys are unique within a depth
        s, r = flat // k, flat % k
        taken.view(bs, -1)[rows, flat] = True
        parent[:, n] = s
        depth[:, n] = depth[rows, s] + 1
        key[:, n] = key[rows, s] * k + r
        score[:, n] = cand_score.flatten(1)[rows, flat]
        tokens[:, n] = child_tokens[rows, s, r]
        mask[:, n] = mask[rows, s]
        mask[:, n, n] = True
        if n + 1 < n_max:  # (the last node's children could never be taken)
            child_tokens[:, n], child_logp[:, n] = children(tokens[:, n], depth[:, n])
    first_child, next_sibling = _child_links(parent)
    retrive_index = rows[:, None] * n_max + torch.arange(n_max, device=dev)
    return DraftTree(tokens, parent, depth, score, mask, retrive_index, first_child, next_sibling, depth_max)


def _lexi_best(valid: Tensor, *keys: tuple[Tensor, bool]) -> Tensor:
    """Mask of the valid entries that are best under the lexicographic order of `keys` (value, larger_is_better).

    Reduces over the last two dims; -inf scores are legal, so validity is tracked by mask, not by sentinel.
    """
    tie = valid
    for value, larger in keys:
        if value.is_floating_point():
            fill = float("-inf") if larger else float("inf")
        else:
            info = torch.iinfo(value.dtype)
            fill = info.min if larger else info.max
        masked = torch.where(tie, value, torch.full_like(value, fill))
        extreme = masked.flatten(1).amax(1) if larger else masked.flatten(1).amin(1)
        tie = tie & (value == extreme[:, None, None])
    return tie


def _child_links(parent: Tensor) -> tuple[Tensor, Tensor]:
    """First-child and next-sibling arrays [bs, N] int64 in node order (-1 = none)."""
    n = parent.shape[1]
    ids = torch.arange(n, device=parent.device)
    is_child = parent[:, None, :] == ids[None, :, None]  # [bs, i, j]: j is a child of i
    first_child = torch.where(is_child.any(2), is_child.int().argmax(2), -1)
    later = ids[None, :] > ids[:, None]  # [i, j]: j after i
    sibling = (parent[:, :, None] == parent[:, None, :]) & later & (parent[:, :, None] >= 0)
    next_sibling = torch.where(sibling.any(2), sibling.int().argmax(2), -1)
    return first_child.long(), next_sibling.long()
