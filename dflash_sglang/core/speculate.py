"""One decode step's proposal and acceptance, written once: the reference decoder and the SGLang worker call these.

A step verifies n = shape.nodes tokens per request (its verify rows): the root (bonus token) plus drafts. A chain
takes the drafter's argmax at the first n-1 block positions (a DFlash2 selector's walk) and verifies causally; a tree
(top-k per position, best-first, core/step/tree.py) verifies with an ancestor mask. The caller supplies what differs by
where it runs:
- the draft scores (`DraftScores`): one process's draft logits (`DraftLogits`, with an optional token map), the
  SGLang worker's vocab-parallel merge over TP ranks (adapter/scale/tp.py), or a DFlash2 drafter's selector
  (`PathScores`, core/draft/selector.py: its chain is a walk, `walk`, sampled at the request's temperature with its q,
  and its tree's children depend on their parent's token);
- the tree kernels (`TreeKernels`): core's references here, dflash_sglang.ops (CUDA kernels) in the worker;
- the uniforms' generator (None: torch's default one, seeded by SGLang's --random-seed).
`kept_rows` marks which verified rows stay committed (root + accepted path), which is all the reference needs to
crop its caches; the worker commits by slot instead (the tree result's commit_loc / free_loc).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .draft.token_map import to_target_ids
from .shape.adaptive import SpecShape
from .step.accept import (AcceptResult, DraftQ, SamplingParams, draw_uniforms, greedy_accept, rejection_accept,
                          target_probs)
from .step.tree import DraftTree, build_tree
from .step.tree_verify import verify_tree_greedy, verify_tree_sampling
from .step.vocab_parallel import VocabShard, local_ranks


class DraftScores(Protocol):
    """The drafter's opinion over block positions 1..B-1 (D = B-1 of them), as target token ids."""

    def argmax(self, count: int) -> Tensor:
        """[bs, count] int64: the best token at each of the first count positions (a chain's drafts)."""
        ...

    def top_logprobs(self, k: int) -> tuple[Tensor, Tensor]:
        """(tokens [bs, D, k] int64, log-probs [bs, D, k] float32): each position's k best, the inputs of build_tree."""
        ...

    def ranks(self, tokens: Tensor) -> Tensor | None:
        """tokens [bs, m] int64 target ids at positions 1..m -> [bs, m] int64: the drafter's rank of each (1: its
        best; vocab_parallel.NOT_RANKED: a token it cannot propose), or None where it is not measured."""
        ...


@runtime_checkable
class PathScores(Protocol):
    """Scores whose proposals depend on the path drawn so far (DFlash2's selector, core/draft/selector.py
    SelectorScores): `walk` is the chain's walk (the best path on greedy rows, sampled where the request samples; a
    chain of DraftScores takes `argmax` instead), `chain_q` the distribution it was drawn from, and a tree grows node by
    node from its parents' tokens instead of per-position top-k."""

    def walk(self, count: int) -> Tensor:
        """[bs, count] int64: the walk's first count drafts (a chain's)."""
        ...

    def chain_q(self, count: int) -> DraftQ | None:
        """The first count drafts' proposal distribution (None: point masses)."""
        ...

    def tree(self, root: Tensor, nodes: int, topk: int) -> DraftTree: ...

    def ranks(self, tokens: Tensor) -> Tensor | None: ...


@dataclass(frozen=True)
class DraftLogits:
    """Draft logits of one process: [bs, D, V], or [bs, D, K] over token_map's K target ids (core/draft/token_map.py;
    proposals are mapped back to target ids, so the verify is the same as with a full-vocabulary drafter)."""

    logits: Tensor
    token_map: Tensor | None = None

    def argmax(self, count: int) -> Tensor:
        return to_target_ids(self.logits[:, :count].argmax(-1), self.token_map)

    def top_logprobs(self, k: int) -> tuple[Tensor, Tensor]:
        return draft_topk(self.logits, k, self.token_map)

    def ranks(self, tokens: Tensor) -> Tensor:
        rows = self.logits.shape[-1]
        shard = VocabShard(0, rows, None if self.token_map is None else self.token_map.to(tokens.device))
        return local_ranks(self.logits[:, : tokens.shape[1]], shard, tokens)


@dataclass(frozen=True)
class TreeKernels:
    """The tree ops a step calls, with core/step/tree.py and core/step/tree_verify.py's signatures (the worker passes
    dflash_sglang.ops', which run CUDA kernels on CUDA tensors)."""

    build_tree: Callable[..., DraftTree] = build_tree
    verify_tree_greedy: Callable = verify_tree_greedy
    verify_tree_sampling: Callable = verify_tree_sampling


REFERENCE_KERNELS = TreeKernels()


@dataclass(frozen=True)
class Proposal:
    ids: Tensor  # [bs, n] int64: root then drafts (chain order, or tree node order)
    depth: Tensor  # [bs, n] int64: position offset from the root
    tree: DraftTree | None  # None for a chain (plain causal verify)
    q: DraftQ | None = None  # a sampled chain's proposal distribution (PathScores); None: point masses

    def attention_mask(self) -> Tensor:
        """[bs, n, n] bool: row i may attend to verify row j (ancestors and itself)."""
        if self.tree is not None:
            return self.tree.mask
        bs, n = self.ids.shape
        return torch.ones(n, n, dtype=torch.bool, device=self.ids.device).tril().expand(bs, n, n)


def draft_block(shape: SpecShape, block: int) -> int:
    """The drafter block a step of `shape` runs, with the drafter's block B = `block`: a chain of n < B rows drafts
    [bonus, MASK x (n-1)], its n-1 drafts and no more (the pass's work grows with its rows: on the 2-core CPU a 4-row
    pass over 16 requests took half the time of a 16-row one, for ~1% lower acceptance of those drafts; docs/
    benchmarks.md); a tree, whose nodes may sit at any depth, the whole block. Lossless either way: the verify
    accepts only what the target would have produced."""
    return min(shape.nodes, block) if shape.is_chain and shape.nodes > 1 else block


def propose(bonus: Tensor, scores: DraftScores | PathScores | None, shape: SpecShape,
            kernels: TreeKernels = REFERENCE_KERNELS) -> Proposal:
    """bonus [bs] int64, scores over block positions 1..B-1 (None when shape.nodes == 1: no drafter pass).

    A chain of n verifies [bonus, the first n-1 argmax drafts]: point-mass proposals, lossless for any sampling (with
    PathScores, the first n-1 steps of the selector's walk, and the q they were drawn from where sampled).
    A tree verifies the best-first tree of shape.nodes nodes built from each position's top shape.topk (with
    PathScores, from each node's top shape.topk children: still point masses, deterministic given the draft).
    """
    bonus = bonus.to(torch.int64)
    bs, n = bonus.shape[0], shape.nodes
    path = isinstance(scores, PathScores)
    if shape.is_chain:
        drafts, q = bonus.new_zeros(bs, 0), None
        if n > 1:
            assert scores is not None, "a chain of more than one row needs draft scores"
            drafts = scores.walk(n - 1) if path else scores.argmax(n - 1)
            q = scores.chain_q(n - 1) if path else None
            assert drafts.shape[1] == n - 1, "block too short for the chain"
        ids = torch.cat([bonus[:, None], drafts], dim=1)
        depth = torch.arange(n, device=bonus.device).repeat(bs, 1)  # a chain is a tree of depth i at node i
        return Proposal(ids, depth, None, q)
    assert scores is not None
    if path:  # (no kernel of its own yet: the children of a node are found when the node is)
        tree = scores.tree(bonus, n, shape.topk)
    else:
        topk_tokens, topk_logp = scores.top_logprobs(shape.topk)
        tree = kernels.build_tree(bonus, topk_tokens.contiguous(), topk_logp.contiguous(), n)
    return Proposal(tree.tokens, tree.depth, tree)


def draft_topk(draft_logits: Tensor, k: int, token_map: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """draft_logits [bs, D, V] -> (topk_tokens [bs, D, k] int64, topk_logp [bs, D, k] float32), the inputs of
    build_tree. Log-probs are taken in float32 so the tree (and its tie-breaks) does not depend on the lm_head
    dtype. With token_map [K] int64 the logits are [bs, D, K] over the map's ids and the tokens come back as
    target ids (log-probs normalised over the K ids: the tree only compares them)."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    topk_logp, topk_tokens = logp.topk(k, dim=-1)
    return to_target_ids(topk_tokens, token_map), topk_logp


def accept(proposal: Proposal, logits: Tensor, params: SamplingParams | None, generator: torch.Generator | None = None,
           slots: Tensor | None = None, kernels: TreeKernels = REFERENCE_KERNELS) -> AcceptResult:
    """logits [bs, n, V] from the target at the verify rows (row i predicts the token after row i) -> the step's
    AcceptResult (a TreeAcceptResult for a tree).

    params None: every request greedy (longest matching prefix / path). Otherwise lossless rejection sampling of
    the drafts (point masses, or a sampled chain's proposal.q) against target_probs (temperature, top-k, top-p,
    min-p; greedy rows one-hot), uniforms drawn from `generator` (None: torch's default). slots [bs, n] int64: each
    tree node's KV slot, split by the verify into commit_loc / free_loc (trees only).
    """
    bs, n = proposal.ids.shape
    if proposal.tree is None:
        draft = proposal.ids[:, 1:]
        if params is None:
            return greedy_accept(draft, logits.argmax(-1))
        coins, u = draw_uniforms(bs, n - 1, generator, logits.device)
        if params.hints is None or params.hints.sampled is None:
            return rejection_accept(draft, target_probs(logits, params), coins, u, proposal.q)
        return _mixed_chain_accept(draft, logits, params, coins, u, proposal.q)
    if params is None:
        return kernels.verify_tree_greedy(proposal.tree, logits.argmax(-1), slots)
    coins, u = draw_uniforms(bs, n, generator, logits.device)
    probs = target_probs(logits, params).contiguous()
    return kernels.verify_tree_sampling(proposal.tree, probs, coins.contiguous(), u.contiguous(), slots)


def _mixed_chain_accept(draft: Tensor, logits: Tensor, params: SamplingParams, coins: Tensor, u: Tensor,
                        q: DraftQ | None) -> AcceptResult:
    """A chain's acceptance when the host knows which rows sample (params.hints.sampled [m]): the greedy rows by
    greedy acceptance, the m sampling rows by rejection sampling on their own target distribution, with the uniforms
    they would draw in the whole batch. The same result as rejection sampling every row against target_probs'
    one-hot greedy rows (which accepts a draft iff it is the argmax and then draws the argmax), without a [bs, n, V]
    distribution for the greedy rows."""
    result = greedy_accept(draft, logits.argmax(-1))
    rows = params.hints.sampled
    if rows.numel() == 0:
        return result
    sub_q = None if q is None else DraftQ(q.tokens[rows], q.probs[rows])
    sub = rejection_accept(draft[rows], target_probs(logits[rows], params.sampling_rows()), coins[rows], u[rows],
                           sub_q)
    return AcceptResult(result.accept_len.index_copy(0, rows, sub.accept_len),
                        result.out_tokens.index_copy(0, rows, sub.out_tokens),
                        result.bonus.index_copy(0, rows, sub.bonus))


def kept_rows(proposal: Proposal, result: AcceptResult) -> Tensor:
    """[bs, n] bool: the verify rows the step commits (the root and the accepted drafts or path)."""
    rows = torch.arange(proposal.ids.shape[1], device=proposal.ids.device)
    if proposal.tree is None:
        return rows[None] <= result.accept_len[:, None]
    return (result.accept_nodes[:, :, None] == rows[None, None, :]).any(1)


def committed_ranks(scores: DraftScores, result: AcceptResult, nodes: int, positions: int) -> Tensor | None:
    """The drafter's rank of each token a step committed, for the goodput controller's tree pricing
    (core/shape/goodput.py): [bs, m] int64 at depths 1..m, m = min(nodes, positions) (positions: the draft positions the
    scores cover), 0 past a request's commit (accept_len + 1 tokens: the accepted drafts, then the bonus); None where
    not measured."""
    m = min(nodes, positions)
    if m < 1:
        return None
    ranks = scores.ranks(result.out_tokens[:, :m].clamp_min(0))
    if ranks is None:
        return None
    depth = torch.arange(m, device=ranks.device)
    return torch.where(depth[None] <= result.accept_len[:, None].to(ranks.device), ranks, torch.zeros_like(ranks))


def rank_paths(ranks: list[list[int]]) -> list[list[int]]:
    """committed_ranks' rows on the host -> each request's ranks at depths 1, 2, ... (the zeros past it dropped)."""
    return [[r for r in row if r > 0] for row in ranks]
