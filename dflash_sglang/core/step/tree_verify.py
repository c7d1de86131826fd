"""Tree verification: greedy and lossless sampling (the reference for the `verify_tree` CUDA op).

Same conventions as the chain in core/step/accept.py, so a K = 1 tree verifies exactly like the chain:
- `accept_len [bs]` counts accepted non-root nodes; `accept_nodes [bs, D+1]` is the root, then the accepted
  path's node ids, then -1; `out_tokens [bs, D+1]` holds the accepted draft tokens, the bonus token at index
  accept_len, then -1.
- Randomness is passed in: `coins [bs, N]` (one per node, index = node id, column 0 unused) and `resample_u [bs]`.
- Sampling, with point-mass drafts (SGLang's tree_speculative_sampling_target_only): at the current node with
  target distribution p, try its children in node order. Child c is accepted iff
  `coins[c] * (1 - removed) < r(c.token)`, where r is the residual (p with the rejected siblings' tokens
  zeroed) and `removed` is the float32 running sum of the mass zeroed so far, i.e. `coins[c] < r / sum(r)`
  with sum(r) = 1 - removed for a normalised p. Each rejection is exact rejection sampling against a point
  mass, so the emitted token is distributed as p. An accepted child becomes the current node (fresh p);
  when none is, the bonus is drawn from the residual with `resample_u` (core/step/accept.py: sample_from).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .accept import AcceptResult, sample_from
from .tree import DraftTree


@dataclass(frozen=True)
class TreeAcceptResult(AcceptResult):
    accept_nodes: Tensor  # [bs, D+1] int64: root (0), accepted path node ids, then -1
    commit_loc: Tensor | None = None  # [bs, D+1] int64: KV slots of accept_nodes (to keep), then -1
    free_loc: Tensor | None = None  # [bs, N-1] int64: KV slots of the other nodes in node order, then -1


def verify_tree_greedy(tree: DraftTree, target_argmax: Tensor, out_cache_loc: Tensor | None = None) -> TreeAcceptResult:
    """Greedy tree verification: follow the child whose token equals the target's choice at the current node.

    target_argmax [bs, N] int64 — the target's argmax after each node; out_cache_loc [bs, N] int64 or None —
    KV slot of each node (from core/step/block.py build_tree_inputs), to split into commit / free slots.
    """
    check_verify_args(tree, target_argmax, "target_argmax", out_cache_loc)
    bs, n = tree.tokens.shape
    cur = torch.zeros(bs, dtype=torch.int64, device=tree.tokens.device)
    alive = torch.ones(bs, dtype=torch.bool, device=cur.device)
    path = torch.full((bs, tree.max_depth + 1), -1, dtype=torch.int64, device=cur.device)
    path[:, 0] = 0
    for level in range(1, tree.max_depth + 1):
        want = target_argmax.gather(1, cur[:, None])
        hit = (tree.parent == cur[:, None]) & (tree.tokens == want) & alive[:, None]
        found = hit.any(1)
        cur = torch.where(found, hit.int().argmax(1), cur)  # argmax returns the first hit: node order
        alive &= found
        path[:, level] = torch.where(found, cur, -1)
    bonus = target_argmax.gather(1, cur[:, None]).squeeze(1)
    return _finish(tree, path, bonus, out_cache_loc)


def verify_tree_sampling(
    tree: DraftTree, target_probs: Tensor, coins: Tensor, resample_u: Tensor, out_cache_loc: Tensor | None = None
) -> TreeAcceptResult:
    """Lossless tree speculative sampling with point-mass drafts (rule in the module docstring).

    target_probs [bs, N, V] float32 — target distribution after each node (temperature/top-k/top-p applied);
    coins [bs, N] float32 uniforms, index = node id (column 0 unused); resample_u [bs] float32 uniform;
    out_cache_loc as in verify_tree_greedy.
    """
    check_sampling_args(tree, target_probs, coins, resample_u, out_cache_loc)
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    rows = torch.arange(bs, device=dev)
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    alive = torch.ones(bs, dtype=torch.bool, device=dev)
    path = torch.full((bs, tree.max_depth + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    final = target_probs[:, 0].clone()  # residual at the node where each row stops
    for level in range(1, tree.max_depth + 1):
        residual = target_probs[rows, cur].clone()
        removed = torch.zeros(bs, dtype=torch.float32, device=dev)
        moved = torch.zeros_like(alive)
        # Only nodes at this depth can be children of the current node; visit them in node order.
        for j in (tree.depth == level).any(0).nonzero().flatten().tolist():
            tok = tree.tokens[:, j : j + 1]
            is_child = alive & ~moved & (tree.parent[:, j] == cur)
            r_tok = residual.gather(1, tok).squeeze(1)  # 0 for a token rejected earlier at this node
            accept = is_child & (coins[:, j] * (1 - removed) < r_tok)
            reject = is_child & ~accept
            removed = torch.where(reject, removed + r_tok, removed)
            residual.scatter_(1, tok, torch.where(reject, 0.0, r_tok)[:, None])
            moved |= accept
            cur = torch.where(accept, j, cur)
        stop = alive & ~moved
        final = torch.where(stop[:, None], residual, final)
        alive &= moved
        path[:, level] = torch.where(alive, cur, -1)
    final = torch.where(alive[:, None], target_probs[rows, cur], final)  # accepted down to a leaf
    # A residual without mass can only come from rounding; the target distribution itself is exact then.
    final = torch.where((final > 0).any(1, keepdim=True), final, target_probs[rows, cur])
    bonus = sample_from(final, resample_u)
    return _finish(tree, path, bonus, out_cache_loc)


def check_verify_args(tree: DraftTree, target: Tensor, name: str, out_cache_loc: Tensor | None) -> None:
    """Shape checks shared with the kernel wrapper (dflash_sglang/ops/tree.py)."""
    bs, n = tree.tokens.shape
    dim = 3 if name == "target_probs" else 2
    if target.dim() != dim or target.shape[:2] != (bs, n):
        raise ValueError(f"{name} must be [bs, N{', V' if dim == 3 else ''}] with bs={bs} N={n}, got "
                         f"{tuple(target.shape)}")
    if out_cache_loc is not None and out_cache_loc.shape != (bs, n):
        raise ValueError(f"out_cache_loc must be [{bs}, {n}], got {tuple(out_cache_loc.shape)}")


def check_sampling_args(
    tree: DraftTree, target_probs: Tensor, coins: Tensor, resample_u: Tensor, out_cache_loc: Tensor | None
) -> None:
    check_verify_args(tree, target_probs, "target_probs", out_cache_loc)
    bs, n = tree.tokens.shape
    if coins.shape != (bs, n) or resample_u.shape != (bs,):
        raise ValueError(f"coins must be [{bs}, {n}] and resample_u [{bs}], got {tuple(coins.shape)}, "
                         f"{tuple(resample_u.shape)}")
    if {target_probs.dtype, coins.dtype, resample_u.dtype} != {torch.float32}:
        raise ValueError(f"target_probs, coins and resample_u must be float32, got {target_probs.dtype}, "
                         f"{coins.dtype}, {resample_u.dtype}")


def _finish(tree: DraftTree, path: Tensor, bonus: Tensor, out_cache_loc: Tensor | None) -> TreeAcceptResult:
    """Accepted path [bs, D+1] (-1 padded) + bonus [bs] -> every output of the verify op."""
    bs, n = tree.tokens.shape
    on_path = path >= 0
    accept_len = on_path[:, 1:].sum(1)
    width = path.shape[1]
    j = torch.arange(width, device=path.device)[None]
    drafts = tree.tokens.gather(1, path[:, 1:].clamp_min(0))  # [bs, D]
    out = torch.where(on_path[:, 1:], drafts, -1)
    out = torch.cat([out, out.new_full((bs, 1), -1)], dim=1)
    out = torch.where(j == accept_len[:, None], bonus[:, None], out)
    commit = free = None
    if out_cache_loc is not None:
        loc = out_cache_loc.to(torch.int64)
        commit = torch.where(on_path, loc.gather(1, path.clamp_min(0)), -1)
        kept = torch.zeros(bs, n, dtype=torch.bool, device=path.device)
        kept.scatter_(1, path.clamp_min(0), True)  # -1 padding lands on the root, which is kept
        # Stable sort on `kept` lists the freed nodes first, in node order.
        order = kept.long().argsort(dim=1, stable=True)[:, : n - 1]
        n_free = (n - 1 - accept_len)[:, None]
        free = torch.where(torch.arange(n - 1, device=path.device)[None] < n_free, loc.gather(1, order), -1)
    return TreeAcceptResult(accept_len, out, bonus, path, commit, free)
