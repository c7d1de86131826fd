"""Trees as goodput-controller candidates: core/shape/acceptance.py's tree pricing and the controller choosing trees.

The simulated server draws, for every request and step, the rank the target's token has in the drafter's ranking at
each depth (independently, from a known q_d(r)); a step of a given shape accepts the longest prefix of that rank path
which the shape's node set holds (a chain: rank 1 at every depth; a tree: the best-first set over the true q, as
core/step/tree.py builds it from the drafter's probabilities) and reports the ranks of the committed tokens, as the
worker does. Step costs come from a known linear cost with a tree term.
"""
from __future__ import annotations

import heapq
import random

import pytest
import torch

from dflash_sglang.core.shape.acceptance import Calibration, RankModel, expected_tokens, tree_tokens
from dflash_sglang.core.shape.adaptive import SpecShape
from dflash_sglang.core.shape.goodput import GoodputConfig, GoodputController, features, label
from dflash_sglang.core.speculate import DraftLogits, committed_ranks, rank_paths
from dflash_sglang.core.step.accept import AcceptResult
from dflash_sglang.core.step.vocab_parallel import NOT_RANKED

DEPTH = 15


def cost(theta, shape: SpecShape, bs: int) -> float:
    return sum(t * f for t, f in zip(theta, features(shape, bs)))


def node_set(q, shape: SpecShape) -> set[tuple[int, ...]]:
    """The best-first node set (rank paths, 1-based ranks) of `shape` over the true q."""
    if shape.is_chain:
        return {(1,) * d for d in range(1, shape.nodes)}
    taken: set[tuple[int, ...]] = set()
    heap = [(-q[0][r], (r + 1,)) for r in range(shape.topk)]
    heapq.heapify(heap)
    while len(taken) < shape.nodes - 1:
        neg, path = heapq.heappop(heap)
        taken.add(path)
        if len(path) < len(q):
            for r in range(shape.topk):
                heapq.heappush(heap, (neg * q[len(path)][r], path + (r + 1,)))
    return taken


def true_tokens(q, shape: SpecShape) -> float:
    """Committed tokens per request of `shape` under independent ranks (the oracle's E)."""
    total = 1.0
    for path in node_set(q, shape):
        p = 1.0
        for d, r in enumerate(path):
            p *= q[d][r - 1]
        total += p
    return total


class World:
    """A simulated server: rank distribution q[d][r-1] per depth (the rest: a token the drafter ranks past them),
    a linear step cost, and `tree_hit`: the chance a tree accepts a matching node of rank > 1 (1: the target's token
    in the tree is accepted, as greedy verification does; less: a verifier that accepts a node set less often)."""

    def __init__(self, q, theta, tree_hit: float = 1.0, seed: int = 0) -> None:
        self.q, self.theta, self.tree_hit = q, theta, tree_hit
        self.rng = random.Random(seed)
        self._sets: dict[SpecShape, set] = {}

    def draw_path(self) -> list[int]:
        path = []
        for row in self.q:
            u, r = self.rng.random(), 0
            while r < len(row) and u >= row[r]:
                u -= row[r]
                r += 1
            path.append(r + 1 if r < len(row) else NOT_RANKED)
        return path

    def step(self, shape: SpecShape, bs: int) -> tuple[list[int], list[list[int]], float]:
        nodes = self._sets.setdefault(shape, node_set(self.q, shape))
        accepted, ranks = [], []
        for _ in range(bs):
            path, a = self.draw_path(), 0
            while a < len(path) and tuple(path[: a + 1]) in nodes and (
                    path[a] == 1 or shape.is_chain or self.rng.random() < self.tree_hit):
                a += 1
            accepted.append(a)
            ranks.append(path[: min(a + 1, DEPTH)] if shape.nodes > 1 else [])
        return accepted, ranks, cost(self.theta, shape, bs)


def run(ctrl: GoodputController, world: World, steps: int, bs: int) -> tuple[float, list[SpecShape]]:
    tokens, clock, chosen = 0, 0.0, []
    for _ in range(steps):
        shape = ctrl.choose(bs).shape
        accepted, ranks, seconds = world.step(shape, bs)
        ctrl.observe(shape, accepted, seconds, ranks if shape.nodes > 1 else None)
        tokens, clock = tokens + bs + sum(accepted), clock + seconds
        chosen.append(shape)
    return tokens / clock, chosen


def oracle(world: World, shapes, bs: int) -> tuple[SpecShape, float]:
    best = max(shapes, key=lambda s: true_tokens(world.q, s) / cost(world.theta, s, bs))
    return best, bs * true_tokens(world.q, best) / cost(world.theta, best, bs)


CHAINS = tuple(SpecShape(n, 1) for n in (1, 2, 3, 4, 6, 8, 12, 16))
TREES = tuple(SpecShape(n, k) for k in (2, 4) for n in (4, 6, 8, 12, 16))
# a drafter whose best token is right half the time and whose second and third often are
SPREAD = [[0.5, 0.25, 0.1, 0.05]] * DEPTH
# memory-bound verify (extra rows nearly free), a cheap tree
GPU_LIKE = (0.002, 0.004, 0.0002, 0.003, 0.0005, 0.0005)
# compute-bound verify, an expensive tree
CPU_LIKE = (0.002, 0.032, 0.004, 0.020, 0.004, 0.060)


def config(**kw) -> GoodputConfig:
    return GoodputConfig(max_nodes=16, max_depth=DEPTH, max_topk=4, **kw)


def test_tree_tokens_is_the_chain_formula_at_top_1_and_best_first_above():
    rates = [0.7, 0.5, 0.9]
    probs = [[r, 0.1] for r in rates]
    assert tree_tokens(probs, 4, 1) == pytest.approx([expected_tokens(rates, n) for n in range(1, 5)])
    # depth 1: 0.5 (rank 1), 0.3 (rank 2); then 0.3 (1, 1), 0.18 (2, 1) before 0.1 (1, 2)
    assert tree_tokens([[0.5, 0.3], [0.6, 0.2]], 5, 2) == pytest.approx([1, 1.5, 1.8, 2.1, 2.28])
    assert tree_tokens([[0.5, 0.3]], 6, 2) == pytest.approx([1, 1.5, 1.8, 1.8, 1.8, 1.8])  # a lattice of 3 nodes


@pytest.mark.parametrize("shape", TREES[:4])
def test_tree_tokens_matches_the_independent_oracle(shape):
    q = [[0.6 - 0.02 * d, 0.2, 0.08, 0.04] for d in range(6)]
    rates = [row[0] for row in q]
    model = RankModel(6, 4, halflife=1e9, prior_strength=0.0)
    model.counts = [[row[r] / (1 - row[0]) for r in range(1, 4)] + [1 - sum(row[1:]) / (1 - row[0])] for row in q]
    assert tree_tokens(model.probs(rates), shape.nodes, shape.topk)[-1] == pytest.approx(true_tokens(q, shape))


def test_rank_model_counts_misses_by_rank_and_beyond():
    m = RankModel(depth=3, topk=4, halflife=1e9, prior_strength=0.0)
    m.observe([[1, 2], [3], [1, 1, 9], [NOT_RANKED]])
    assert m.counts[0] == [0, 1, 0, 1] and m.counts[1] == [1, 0, 0, 0] and m.counts[2] == [0, 0, 0, 1]
    assert m.tail(1) == pytest.approx([0, 0.5, 0])  # ranks 2, 3, 4 given not rank 1 (the rest beyond)
    assert m.probs([0.6, 0.5, 0.4])[0] == pytest.approx([0.6, 0, 0.2, 0])
    prior = RankModel(depth=1, topk=4, halflife=1e9)
    assert prior.tail(1) == pytest.approx([0.2, 0.1, 0.05])  # no observation: the prior


def test_calibration_is_measured_over_predicted_drafts():
    c = Calibration(halflife=1e9, prior_strength=0.0)
    assert c.ratio == 1.0
    c.observe([1, 0, 2], predicted_drafts=2.0)
    assert c.ratio == pytest.approx(3 / 6)


def test_committed_ranks_reads_each_committed_token_in_the_draft_logits():
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]]])  # [1, 3, V=4]
    result = AcceptResult(accept_len=torch.tensor([1]), out_tokens=torch.tensor([[1, 2, -1, -1]]),
                          bonus=torch.tensor([2]))
    ranks = committed_ranks(DraftLogits(logits), result, nodes=4, positions=3)
    assert ranks.tolist() == [[1, 3, 0]]  # token 1 is best at depth 1; token 2 (tied with 3) third at depth 2
    assert rank_paths(ranks.tolist()) == [[1, 3]]
    mapped = DraftLogits(logits[..., :3], token_map=torch.tensor([1, 3, 0]))  # rows are target ids 1, 3, 0
    ranks = committed_ranks(mapped, result, nodes=4, positions=3)
    assert ranks.tolist() == [[3, NOT_RANKED, 0]]  # target id 1 is row 0, third; target id 2 is outside the map


def test_trees_win_where_extra_nodes_are_cheap_and_the_drafters_runners_up_hit():
    world = World(SPREAD, GPU_LIKE, seed=1)
    ctrl = GoodputController(config())
    tps, chosen = run(ctrl, world, steps=800, bs=1)
    best, best_tps = oracle(world, CHAINS + TREES, 1)
    _, chain_tps = oracle(world, CHAINS, 1)
    assert not best.is_chain and best_tps > 1.2 * chain_tps  # the world favours trees ...
    recent = chosen[-200:]
    assert sum(not s.is_chain for s in recent) >= 150, [label(s) for s in recent[-20:]]  # ... the controller too
    assert tps >= 0.85 * best_tps and tps > 1.1 * chain_tps, (tps, best_tps, chain_tps)


def test_chains_stay_where_a_tree_costs_more_than_it_adds():
    world = World(SPREAD, CPU_LIKE, seed=2)
    ctrl = GoodputController(config())
    tps, chosen = run(ctrl, world, steps=800, bs=8)
    best, best_tps = oracle(world, CHAINS + TREES, 8)
    assert best.is_chain
    assert sum(s.is_chain for s in chosen[-200:]) >= 190
    assert tps >= 0.9 * best_tps


def test_trees_that_accept_less_than_their_ranks_promise_are_calibrated_away():
    """The ranks say trees pay, but the verifier accepts a runner-up only a tenth of the time (as multi-draft
    rejection sampling may): the measured tree steps pull the calibration down and chains come back."""
    world = World(SPREAD, GPU_LIKE, tree_hit=0.1, seed=3)
    ctrl = GoodputController(config())
    tps, chosen = run(ctrl, world, steps=1200, bs=1)
    assert max(c.ratio for c in ctrl.calibration.values()) < 0.8
    assert sum(s.is_chain for s in chosen[-200:]) >= 150
    _, chain_tps = oracle(world, CHAINS, 1)
    assert tps >= 0.85 * chain_tps


def test_config_bounds_the_trees():
    assert GoodputConfig(max_nodes=16).trees() == ()
    assert GoodputConfig(max_nodes=8, max_topk=2).trees() == (SpecShape(4, 2), SpecShape(6, 2), SpecShape(8, 2))
    cfg = GoodputConfig(max_nodes=32, max_depth=7, max_topk=4)
    assert cfg.chain_lengths()[-1] == 8  # a chain never outgrows the drafter block
    assert max(s.nodes for s in cfg.trees()) == 32  # a tree may (it is wider, not deeper)
    with pytest.raises(ValueError, match="max_topk"):
        GoodputConfig(max_nodes=4, max_topk=0)
