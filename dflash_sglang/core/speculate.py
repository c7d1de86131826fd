"""From one drafter pass to verify inputs, and from the target's verify logits to committed tokens.

A step verifies T tokens per request: the root (bonus token) plus drafts. A chain takes the drafter's
argmax at the first T-1 block positions and verifies causally; a tree (top-k per position, best-first,
core/tree.py) verifies with an ancestor mask. `keep [bs, T]` marks which verified rows stay committed
(root + accepted path), which is all the caller needs to crop its KV caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .accept import AcceptResult, SamplingParams, draw_uniforms, greedy_accept, rejection_accept, target_probs
from .adaptive import SpecShape
from .token_map import to_target_ids
from .tree import DraftTree, build_tree
from .tree_verify import verify_tree_greedy, verify_tree_sampling


@dataclass(frozen=True)
class Proposal:
    ids: Tensor  # [bs, T] int64: root then drafts (chain order, or tree node order)
    depth: Tensor  # [bs, T] int64: position offset from the root
    tree: DraftTree | None  # None for a chain (plain causal verify)

    def attention_mask(self) -> Tensor:
        """[bs, T, T] bool: row i may attend to verify row j (ancestors and itself)."""
        if self.tree is not None:
            return self.tree.mask
        bs, t = self.ids.shape
        return torch.ones(t, t, dtype=torch.bool, device=self.ids.device).tril().expand(bs, t, t)


def propose(bonus: Tensor, draft_logits: Tensor | None, shape: SpecShape, token_map: Tensor | None = None) -> Proposal:
    """bonus [bs] int64, draft_logits [bs, B-1, V] (block positions 1..B-1; None when shape.nodes == 1).

    token_map [K] int64 (core/token_map.py): draft_logits are [bs, B-1, K] over those target ids; proposals are
    mapped back to target ids, so the verify is the same as with a full-vocabulary drafter.
    """
    bs = bonus.shape[0]
    if shape.is_chain:
        n_draft = shape.nodes - 1
        if n_draft:
            assert draft_logits is not None and draft_logits.shape[1] >= n_draft, "block too short for the chain"
            # point-mass proposals: lossless for any sampling
            drafts = to_target_ids(draft_logits[:, :n_draft].argmax(-1), token_map)
        else:
            drafts = bonus.new_zeros(bs, 0)
        ids = torch.cat([bonus[:, None], drafts], dim=1)
        depth = torch.arange(shape.nodes, device=bonus.device).expand(bs, -1)
        return Proposal(ids, depth, None)
    assert draft_logits is not None
    topk_tokens, topk_logp = draft_topk(draft_logits, shape.topk, token_map)
    tree = build_tree(bonus, topk_tokens, topk_logp, shape.nodes)
    return Proposal(tree.tokens, tree.depth, tree)


def draft_topk(draft_logits: Tensor, k: int, token_map: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """draft_logits [bs, D, V] -> (topk_tokens [bs, D, k] int64, topk_logp [bs, D, k] float32), the inputs of
    build_tree. Log-probs are taken in float32 so the tree (and its tie-breaks) does not depend on the lm_head
    dtype. With token_map [K] int64 the logits are [bs, D, K] over the map's ids and the tokens come back as
    target ids (log-probs normalised over the K ids: the tree only compares them)."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    topk_logp, topk_tokens = logp.topk(k, dim=-1)
    return to_target_ids(topk_tokens, token_map), topk_logp


def accept(
    proposal: Proposal, logits: Tensor, params: SamplingParams, gen: torch.Generator | None
) -> tuple[AcceptResult, Tensor]:
    """logits [bs, T, V] from the target at the verify rows -> (AcceptResult, keep [bs, T] bool)."""
    bs, t = proposal.ids.shape
    greedy = bool(params.greedy.all())
    if proposal.tree is None:
        draft = proposal.ids[:, 1:]
        if greedy:
            result = greedy_accept(draft, logits.argmax(-1))
        else:
            coins, u = draw_uniforms(bs, t - 1, gen, logits.device)
            result = rejection_accept(draft, target_probs(logits, params), coins, u)
        keep = torch.arange(t, device=logits.device)[None] <= result.accept_len[:, None]
        return result, keep
    if greedy:
        result = verify_tree_greedy(proposal.tree, logits.argmax(-1))
    else:
        coins, u = draw_uniforms(bs, t, gen, logits.device)
        result = verify_tree_sampling(proposal.tree, target_probs(logits, params), coins, u)
    nodes = torch.arange(t, device=logits.device)
    keep = (result.accept_nodes[:, :, None] == nodes[None, None, :]).any(1)
    return result, keep
