"""What a verify shape is expected to commit, from acceptance measured online (the goodput controller's numerator).

Chains. A chain of n rows (the bonus and n-1 drafts) commits E(n) = 1 + sum_{k<n} prod_{d<=k} a_d tokens per
request, a_d the rate at which the drafter's best token at draft depth d is accepted once depth d-1 was.
`AcceptanceModel` estimates a_d from each step's accepted lengths (exponentially forgotten counts, a Beta prior)
and restarts them when a change detector sees the traffic change (below).

Trees. A DFlash drafter proposes every block position in one pass, so the candidates at depth d (its top-k there)
do not depend on the path above them, and a best-first tree of n nodes and top-k k (core/step/tree.py) holds the n-1
most likely rank paths (r_1, ..., r_d), r_i <= k. With q_d(r), the probability that the target's token at depth d
is the drafter's rank-r candidate there once depth d-1 was reached, a path is accepted with prod_i q_i(r_i) and the
tree commits E(n, k) = 1 + the sum of its n-1 best paths' probabilities (`tree_tokens`: one best-first expansion
gives every n at once; k = 1 is the chain formula). q_d(1) = a_d (the chain's own rate, with its change detection);
the rest, q_d(r) = (1 - a_d) * s_d(r), comes from `RankModel`: where in the drafter's own ranking the tokens the
target committed fell when they were not its best. Every drafted step measures those ranks (chains too: the token
the target put where a draft was rejected has a rank in that position's draft logits), so trees are priced before
any is verified. The independence across depths is an approximation and multi-draft rejection sampling accepts a
node set less often than the target samples into it, so what tree steps actually accepted calibrates the prediction
(`Calibration`, per top-k: measured over predicted accepted drafts).

Change detection: acceptance is forgotten slowly (`halflife` steps), which keeps the estimate steady, but a change
of traffic (new prompts, a predictable request finishing) would then be followed tens to hundreds of steps late.
CUSUMs (Page, 1954) of the log-likelihood ratio of each step's accepted drafts, for every depth's rate dropping by
`change_factor` against staying at the estimate, and for its miss rate dropping so (a rise), catch it: past
`change_threshold` the estimate restarts from the counts of the steps since that CUSUM last left zero (its estimate
of when the change happened), so nothing of the old regime is kept. At one request a step tests one or two drafts,
and a change is caught in about ten steps (the forgetting alone took about a hundred).

Pure logic, no torch (the goodput controller's tests drive it with fake steps).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def expected_tokens(rates: Sequence[float], nodes: int) -> float:
    """E(n): committed tokens per request of a chain of `nodes` rows (rates[d-1] = a_d)."""
    total, p = 1.0, 1.0
    for d in range(1, nodes):
        p *= rates[d - 1]
        total += p
    return total


def tree_tokens(probs: Sequence[Sequence[float]], nodes: int, topk: int) -> list[float]:
    """E(m, topk) for m = 1..nodes: committed tokens per request of the best-first tree of m nodes (root included)
    whose node at depth d with rank r is accepted with probs[d-1][r-1] once its parent was (ranks <= topk, depth <=
    len(probs)). Entry m-1 is the m-node tree's (so [0] is 1.0, a plain step's)."""
    assert nodes >= 1 and topk >= 1
    out, total = [1.0], 1.0
    depth = len(probs)
    heap: list[tuple[float, int, tuple[int, ...]]] = []  # (-path probability, depth, ranks): the frontier

    def push(p: float, ranks: tuple[int, ...]) -> None:
        d = len(ranks)
        if d < depth:
            for r in range(min(topk, len(probs[d]))):
                heapq.heappush(heap, (-p * probs[d][r], d + 1, ranks + (r,)))

    push(1.0, ())
    while len(out) < nodes and heap:
        neg, _, ranks = heapq.heappop(heap)
        total -= neg
        out.append(total)
        push(-neg, ranks)
    out += [total] * (nodes - len(out))  # (a lattice smaller than `nodes`: no more paths to add)
    return out


def chain_counts(depth: int, nodes: int, accepted: Iterable[int]) -> tuple[list[float], list[float]]:
    """(trials, hits) per depth 1..depth of one chain step of `nodes` rows: depth d was tried where every draft
    before it was accepted, and hit where it was accepted too. accepted: drafts accepted per request."""
    trials, hits = [0.0] * depth, [0.0] * depth
    for a in accepted:
        assert 0 <= a <= nodes - 1, (a, nodes)
        for d in range(min(a + 1, nodes - 1)):
            trials[d] += 1.0
            if a > d:
                hits[d] += 1.0
    return trials, hits


def rank_counts(depth: int, ranks: Iterable[Sequence[int]]) -> tuple[list[float], list[float]]:
    """(trials, hits) per depth from the drafter's rank of each committed token (per request, depths 1, 2, ...):
    a depth reached counts a trial, a rank-1 token a hit (what a chain at that depth would have accepted)."""
    trials, hits = [0.0] * depth, [0.0] * depth
    for path in ranks:
        for d, r in enumerate(path[:depth]):
            trials[d] += 1.0
            hits[d] += 1.0 if r == 1 else 0.0
    return trials, hits


@dataclass
class AcceptanceModel:
    """Per-depth conditional acceptance a_d of the drafter's best token, exponentially forgotten, Beta prior, with
    the change detector of the module docstring."""

    depth: int  # the deepest draft position (max_nodes - 1)
    halflife: float
    prior_rate: float
    prior_strength: float
    change_threshold: float = 0.0  # 0: no change detection
    change_factor: float = 0.5
    trials: list[float] = field(init=False)
    hits: list[float] = field(init=False)
    since: tuple[list[list[float]], list[list[float]]] = field(init=False)  # per CUSUM (drop, rise): (trials, hits)
    # of the steps since it last left zero
    cusum: tuple[float, float] = (0.0, 0.0)  # (evidence of a drop, of a rise): summed log-likelihood ratios
    changes: int = field(init=False, default=0)  # restarts so far

    def __post_init__(self) -> None:
        self.trials = [0.0] * self.depth
        self.hits = [0.0] * self.depth
        self.since = self._no_counts()

    def observe(self, nodes: int, accepted: Iterable[int]) -> None:
        """One chain step of `nodes` rows; accepted: drafts accepted per request (0..nodes-1)."""
        self.observe_counts(*chain_counts(self.depth, nodes, accepted))

    def observe_counts(self, step_trials: list[float], step_hits: list[float]) -> None:
        """One decode step's trials and hits per depth (plain steps too, with none: what is known fades with every
        step, so after a long spell of plain steps the few recent probes outweigh the stale regime)."""
        detect = self.change_threshold > 0 and any(step_trials)
        evidence = self._evidence(step_trials, step_hits) if detect else (0.0, 0.0)  # (before this step counts)
        self.trials, self.hits = (_fade_add(self.trials, step_trials, self.halflife),
                                  _fade_add(self.hits, step_hits, self.halflife))
        if not detect:
            return
        sums = [max(0.0, c + e) for c, e in zip(self.cusum, evidence)]
        for i, total in enumerate(sums):  # the counts since each CUSUM left zero (none while it is at zero)
            trials, hits = self.since[i]
            keep = 1.0 if total > 0 else 0.0
            self.since[i][0] = [keep * (t + x) for t, x in zip(trials, step_trials)]
            self.since[i][1] = [keep * (h + x) for h, x in zip(hits, step_hits)]
        self.cusum = (sums[0], sums[1])
        alarm = max(range(2), key=lambda i: sums[i])
        if sums[alarm] > self.change_threshold:
            # The traffic changed (new prompts, a predictable request finished): the long memory would keep choosing
            # for the old regime for tens of steps, each paying for drafts the new one rejects (or leaving good
            # drafts unused). Restart from the steps since the change began.
            self.trials, self.hits = list(self.since[alarm][0]), list(self.since[alarm][1])
            self.cusum = (0.0, 0.0)
            self.since = self._no_counts()
            self.changes += 1

    def _no_counts(self) -> tuple[list[list[float]], list[list[float]]]:
        return tuple([[0.0] * self.depth, [0.0] * self.depth] for _ in range(2))

    def _evidence(self, trials: list[float], hits: list[float]) -> tuple[float, float]:
        """Log-likelihood ratios of a step's trials for a drop (each depth's rate r -> r * f) and for a rise
        (its miss rate 1 - r -> (1 - r) * f) against the estimate before the step, f = change_factor."""
        f, drop, rise = self.change_factor, 0.0, 0.0
        for t, h, r in zip(trials, hits, self.rates()):
            if t:
                r = min(max(r, 1e-3), 1 - 1e-3)
                drop += h * math.log(f) + (t - h) * math.log((1 - r * f) / (1 - r))
                rise += h * math.log((1 - (1 - r) * f) / r) + (t - h) * math.log(f)
        return drop, rise

    def rates(self) -> list[float]:
        a0, s = self.prior_rate * self.prior_strength, self.prior_strength
        return [(h + a0) / (t + s) for h, t in zip(self.hits, self.trials)]

    def optimistic_rates(self, z: float) -> list[float]:
        """Each depth's rate plus z standard errors (of its forgotten count): what a probe could still find."""
        s = self.prior_strength
        return [min(1.0, m + z * (m * (1 - m) / (t + s)) ** 0.5) for m, t in zip(self.rates(), self.trials)]


@dataclass
class RankModel:
    """s_d(r): where the target's token at depth d fell in the drafter's ranking there, given it was not rank 1
    (r = 2..topk; the rest is 'beyond'), from forgotten counts with a prior that halves with every rank."""

    depth: int
    topk: int  # the largest top-k a tree may use
    halflife: float
    prior_strength: float = 2.0
    prior_second: float = 0.2  # the prior's share of rank 2 among the misses (rank 3 half that, ...)
    counts: list[list[float]] = field(init=False)  # [depth][r - 2] for r = 2..topk, then [depth][topk - 1]: beyond

    def __post_init__(self) -> None:
        self.counts = [[0.0] * self.topk for _ in range(self.depth)]

    def observe(self, ranks: Iterable[Sequence[int]]) -> None:
        """One drafted step: per request, the drafter's rank (1-based) of each committed token at depths 1, 2, ...
        (as far as the step's draft scores reach; a rank above topk, or a token outside a token map, is 'beyond')."""
        decay = 0.5 ** (1.0 / self.halflife)
        self.counts = [[c * decay for c in row] for row in self.counts]
        for path in ranks:
            for d, r in enumerate(path[:self.depth]):
                if r != 1:
                    self.counts[d][min(r, self.topk + 1) - 2] += 1.0

    def tail(self, d: int) -> list[float]:
        """[s_d(2), ..., s_d(topk)] for depth d (1-based)."""
        row = self.counts[d - 1]
        prior = [self.prior_second * 0.5 ** i for i in range(self.topk - 1)]
        n = sum(row) + self.prior_strength
        return [(c + self.prior_strength * p) / n for c, p in zip(row, prior)]

    def probs(self, rates: Sequence[float]) -> list[list[float]]:
        """q_d(r) for d = 1..depth, r = 1..topk, from the chains' rates a_d = q_d(1)."""
        return [[a] + [(1.0 - a) * s for s in self.tail(d)] for d, a in enumerate(rates[:self.depth], start=1)]


@dataclass
class Calibration:
    """Measured over predicted accepted drafts of the tree steps of one top-k (forgotten; a prior of 1)."""

    halflife: float
    prior_strength: float = 2.0  # worth this many requests' predicted drafts
    measured: float = 0.0
    predicted: float = 0.0
    weight: float = 0.0  # forgotten count of requests observed

    def observe(self, accepted: Sequence[int], predicted_drafts: float) -> None:
        decay = 0.5 ** (1.0 / self.halflife)
        self.measured = self.measured * decay + sum(accepted)
        self.predicted = self.predicted * decay + predicted_drafts * len(accepted)
        self.weight = self.weight * decay + len(accepted)

    @property
    def ratio(self) -> float:
        typical = self.predicted / self.weight if self.weight else 1.0
        prior = self.prior_strength * typical
        return (self.measured + prior) / (self.predicted + prior) if self.predicted + prior > 0 else 1.0


def _fade_add(counts: list[float], new: list[float], halflife: float) -> list[float]:
    decay = 0.5 ** (1.0 / halflife)
    return [c * decay + x for c, x in zip(counts, new)]
