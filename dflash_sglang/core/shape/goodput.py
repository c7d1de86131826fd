"""Goodput controller: each decode step's verify shape from acceptance and step cost measured online.

Speculation pays only when the tokens a step commits outweigh what drafting and verifying cost on this hardware,
for this drafter, on this traffic. For a shape s (a chain of n verify rows: the bonus token and n-1 drafts, n = 1
a plain decoding step with no drafter pass; or a best-first tree of n nodes over the top-k of each draft position)
at batch size bs the controller predicts the batch's committed tokens per second

    G(s, bs) = bs * E(s) / T(s, bs)
    E(s)     = committed tokens per request (core/shape/acceptance.py: a chain's from acceptance by depth, a tree's from
               where the target's tokens fall in the drafter's ranking, calibrated by what trees accepted)
    T(s, bs) = theta . [1, bs, bs * (n - 1), drafts, drafts * bs, tree * bs]    (drafts = 1 if n > 1, tree if k > 1)

and verifies the s of the largest G (SmartSpec's goodput, arXiv 2406.14066, over DFlash chains and trees). theta
comes from the steps' wall times (exponentially forgotten least squares, ridge toward a prior, coefficients kept >=
0 so a noisy fit can never make a longer chain look cheaper than a shorter one). The cost model's terms: a fixed
per-step cost, a per-request cost (a plain step), each extra verify row per request (compute-bound verifies pay it in
full, memory-bound ones little), the drafter pass (fixed + per request) and a tree's own work per request (top-k,
tree build, the masked verify). A shape measured at a similar batch size costs what it measured.

Exploration is bounded. Warm-up runs one step each of the longest chain, a plain step and a middle chain
(`warmup_per_shape` of each; a shape's first timed step is left out of the cost fit) to seed both models. After that,
whatever the best shape is, a probe credit of `probe_fraction` of the measured time accrues; when it covers a probe's
predicted loss (its time less what the best shape takes for the tokens it is expected to commit), one step runs a long
chain (the longest whose predicted cost stays within `probe_cost_ratio` of the best step's: it measures acceptance at
every depth it reaches) and the credit pays for it (at most one probe every `probe_gap` steps), provided that chain
could still beat the best step at acceptance `probe_z` standard errors above its estimate (a large batch's probe
measures many requests at once: once drafting is known not to pay there, probes wait until those counts fade). The
floor is plain decoding: each probe after which a plain step is still best doubles the gap to the next (up to
`probe_backoff` x `probe_gap` steps), and the gap returns to `probe_gap` as soon as a drafted shape is best. So with
speculation off the controller spends at most about `probe_fraction` of the time re-checking whether traffic became
predictable, less the longer drafting keeps not paying, and turns speculation back on when it did (within about
`probe_backoff` x `probe_gap` steps). The other way round, while a drafted shape is best, a plain
step is re-priced (reason "reprice") once its batch-size bucket has gone `reprice_gap` steps without one, from the same
credit: a fit over one long chain's steps alone cannot tell the per-request cost from the per-row one (they grow
together), so without measured plain steps a load spike that made drafting slower than plain decoding could leave the
controller on a long chain. Trees need no probes of their own: every drafted step measures
the ranks they are priced from, and a tree whose cost is not measured yet is priced as the chain of its size plus a
tree's prior overhead, so it runs once it looks best and is then priced as measured.

Pure logic: no torch, no clock of its own (the caller passes measured seconds), deterministic, so tests drive it
with a fake clock. The SGLang worker and the reference decoder both use it (docs/structure.md, "One decode step").
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .acceptance import AcceptanceModel, Calibration, RankModel, expected_tokens, rank_counts, tree_tokens
from .adaptive import SpecShape

PLAIN = SpecShape(1, 1)  # a plain decoding step: one verify row, no drafter pass
DEFAULT_TREE_TOPK = 4  # the largest tree top-k by default: trees over top-2 and top-4 are candidates
N_TERMS = 6  # [1, bs, bs*(n-1), drafts, drafts*bs, tree*bs]
TERMS = ("step", "per_request", "per_extra_row", "draft_pass", "draft_per_request", "tree_per_request")


@dataclass(frozen=True)
class GoodputConfig:
    max_nodes: int  # the most verify rows per request (N); chains are also bounded by the drafter block
    max_depth: int | None = None  # the drafter block - 1 (the deepest draft); None: max_nodes - 1
    max_topk: int = 1  # the largest tree top-k (1: chains only)
    candidates: tuple[int, ...] = ()  # chain lengths to choose among (1 = plain); () = 1, 2, 3, 4, 6, 8, 12, 16, ...
    tree_sizes: tuple[int, ...] = (4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree nodes to choose among (<= max_nodes)
    tree_topks: tuple[int, ...] = (2, 4)  # tree top-k to choose among (<= max_topk)
    probe_fraction: float = 0.03  # time share spent on probes of the longest chain while it is not chosen
    accept_halflife: float = 64.0  # decode steps after which an acceptance observation counts half
    rank_halflife: float = 256.0  # ... a rank observation (the tail of the drafter's ranking moves slowly)
    # The change detector (core/shape/acceptance.py): CUSUMs of each step's acceptance log-likelihood ratio, for the
    # rates dropping by change_factor and for the rejection rates dropping by it (a rise); past change_threshold (0 =
    # never) the estimate restarts from the steps since that CUSUM last left zero.
    change_threshold: float = 8.0
    change_factor: float = 0.5
    cost_halflife: float = 256.0  # decode steps after which a step-time observation counts half
    warmup_per_shape: int = 2  # warm-up steps of each of the longest chain, a plain step and a middle chain
    prior_rate: float = 0.4  # acceptance prior at every depth ...
    prior_strength: float = 2.0  # ... worth this many observations
    cost_prior: tuple[float, ...] | None = None  # theta prior (seconds), e.g. from an offline profile; None: from
    # the first measured steps
    prior_weight: float = 1.0  # the cost prior counts as this many steps of each kind
    margin: float = 0.02  # a longer chain must beat the plain step's goodput by this fraction (noise hysteresis)
    probe_gap: int = 12  # at least this many decode steps between probes (more add little information)
    probe_backoff: int = 32  # the gap doubles after each probe that leaves a plain step best, up to this x probe_gap
    # (the floor's cost falls toward nothing; a change of traffic is found within this x probe_gap steps)
    probe_cost_ratio: float = 4.0  # a probe is the longest chain predicted to cost at most this x the best step
    probe_z: float = 2.0  # ... and runs only if, at acceptance this many standard errors above the estimate, it
    # could beat the best step (a large batch's probe measures a lot: once that is known, probes stop until the
    # counts fade)
    reprice_gap: int = 64  # while a drafted shape is best, a plain step at least every this many decode steps of a
    # batch-size bucket (paid from the probe credit): its price is measured, not inferred (0 = never)

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.max_topk < 1:
            raise ValueError(f"max_topk must be >= 1, got {self.max_topk}")
        if self.reprice_gap < 0:
            raise ValueError(f"reprice_gap must be >= 0, got {self.reprice_gap}")
        if self.probe_backoff < 1:
            raise ValueError(f"probe_backoff must be >= 1, got {self.probe_backoff}")
        if not 0 <= self.probe_fraction < 1:
            raise ValueError(f"probe_fraction must be in [0, 1), got {self.probe_fraction}")
        if self.cost_prior is not None and len(self.cost_prior) != N_TERMS:
            raise ValueError(f"cost_prior needs {N_TERMS} terms {TERMS}, got {len(self.cost_prior)}")

    @property
    def depth(self) -> int:
        return self.max_depth if self.max_depth is not None else max(1, self.max_nodes - 1)

    def chain_lengths(self) -> tuple[int, ...]:
        base = self.candidates or (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
        longest = min(self.max_nodes, self.depth + 1)
        return tuple(sorted({min(n, longest) for n in base if n >= 1} | {1, longest}))

    def trees(self) -> tuple[SpecShape, ...]:
        """The tree shapes to choose among: sizes 3..max_nodes (smaller is a chain) x top-k 2..max_topk."""
        sizes = sorted({n for n in self.tree_sizes if 3 <= n <= self.max_nodes})
        topks = sorted({k for k in self.tree_topks if 2 <= k <= self.max_topk})
        return tuple(SpecShape(n, k) for k in topks for n in sizes)


def label(shape: SpecShape) -> str:
    """'4' for a chain of 4 rows, '8x4' for a tree of 8 nodes over top-4 (logs and summaries)."""
    return str(shape.nodes) if shape.is_chain else f"{shape.nodes}x{shape.topk}"


def _shape(s: SpecShape | int) -> SpecShape:
    return s if isinstance(s, SpecShape) else SpecShape(int(s), 1)


def features(shape: SpecShape | int, bs: int) -> tuple[float, ...]:
    """The cost model's terms for a step of `shape` (an int: a chain of that many rows) over `bs` requests."""
    shape = _shape(shape)
    draft = 1.0 if shape.nodes > 1 else 0.0
    tree = 0.0 if shape.is_chain else 1.0
    return (1.0, float(bs), float(bs * (shape.nodes - 1)), draft, draft * bs, tree * bs)



@dataclass(frozen=True)
class FixedStepCost:
    """A decode step's seconds from fixed cost terms instead of the clock: theta . features(shape, bs). With it the
    controller's choices follow acceptance and batch size alone, not the machine's load: deterministic tests and
    what-if runs (`DFLASH_SIMULATE_STEP_COST`, adapter/simulate.py; the reference decoder's `step_cost`)."""

    theta: tuple[float, ...]  # seconds per term, TERMS order

    def __post_init__(self) -> None:
        valid = all(math.isfinite(t) and t >= 0 for t in self.theta)
        if len(self.theta) != N_TERMS or not valid or self.theta[0] + self.theta[1] <= 0:
            raise ValueError(f"a fixed step cost needs {N_TERMS} seconds >= 0 {TERMS}, a plain step's (step + "
                             f"per_request) > 0; got {self.theta}")

    @classmethod
    def parse(cls, text: str) -> FixedStepCost:
        """'0.03,0.001,0.0005,0.01,0.0005,0.001' (seconds per term, TERMS order)."""
        try:
            return cls(tuple(float(x) for x in text.split(",")))
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None

    def seconds(self, shape: SpecShape | int, bs: int) -> float:
        return sum(t * f for t, f in zip(self.theta, features(shape, bs)))

@dataclass
class CostModel:
    """Step seconds as theta . features, by exponentially forgotten least squares with a ridge prior; theta >= 0
    except the fixed term (projected: a coefficient the fit drives negative is pinned to 0 and the rest refitted)."""

    halflife: float
    prior_weight: float
    prior: tuple[float, ...] | None = None
    a: list[list[float]] = field(init=False)  # sum w phi phi^T
    b: list[float] = field(init=False)  # sum w phi y
    seen: list[float] = field(init=False)  # per term: forgotten count of steps that had it nonzero
    measured: dict[tuple[SpecShape, int], tuple[float, float, float]] = field(default_factory=dict)  # (shape,
    # batch-size bucket) -> (mean seconds, mean bs, forgotten weight)
    _theta: list[float] | None = field(init=False, default=None)
    _linear: dict[tuple[SpecShape, int], float] = field(init=False, default_factory=dict)  # memo until observe

    def __post_init__(self) -> None:
        self.a = [[0.0] * N_TERMS for _ in range(N_TERMS)]
        self.b = [0.0] * N_TERMS
        self.seen = [0.0] * N_TERMS

    def observe(self, shape: SpecShape | int, bs: int, seconds: float) -> None:
        shape = _shape(shape)
        decay = 0.5 ** (1.0 / self.halflife)
        for key, (m, b, w) in list(self.measured.items()):  # every shape's measurements fade alike
            self.measured[key] = (m, b, w * decay)
        m, b, w = self.measured.get((shape, _bucket(bs)), (0.0, 0.0, 0.0))
        w += 1.0
        self.measured[(shape, _bucket(bs))] = (m + (seconds - m) / w, b + (bs - b) / w, w)
        phi = features(shape, bs)
        for i in range(N_TERMS):
            self.b[i] = self.b[i] * decay + phi[i] * seconds
            self.seen[i] = self.seen[i] * decay + (1.0 if phi[i] else 0.0)
            for j in range(N_TERMS):
                self.a[i][j] = self.a[i][j] * decay + phi[i] * phi[j]
        if self.prior is None:  # the first plain or drafted step sets a rough prior (see _default_prior)
            self.prior = _default_prior(shape, bs, seconds)
        self._theta = None
        self._linear.clear()

    @property
    def ready(self) -> bool:
        return self.prior is not None

    def theta(self) -> list[float]:
        if self._theta is None:
            self._theta = self._fit()
        return self._theta

    def linear(self, shape: SpecShape | int, bs: int) -> float:
        key = (_shape(shape), bs)
        value = self._linear.get(key)
        if value is None:  # (a step's decision asks for the same shapes several times)
            value = self._linear[key] = max(1e-9, sum(t * f for t, f in zip(self.theta(), features(*key))))
        return value

    def predict(self, shape: SpecShape | int, bs: int) -> float:
        """A shape measured at a similar batch size (the same power-of-two bucket) costs what it measured (scaled by
        the linear model to this bs); others what the linear model says. Real kernels are not linear in the rows: on
        the AVX-512 EPYC a 3-row verify step took longer than a 6-row one."""
        shape = _shape(shape)
        seen = self.measured.get((shape, _bucket(bs)))
        if seen is None or seen[2] < 0.5:
            return self.linear(shape, bs)
        mean_s, mean_bs, _ = seen
        return mean_s * self.linear(shape, bs) / self.linear(shape, max(1, round(mean_bs)))

    def _fit(self) -> list[float]:
        assert self.prior is not None
        # ridge toward the prior, scaled per term so that the prior is worth prior_weight typical steps
        scale = [max(self.a[i][i] / max(self.seen[i], 1e-9), 1e-12) for i in range(N_TERMS)]
        free = list(range(N_TERMS))
        pinned: set[int] = set()
        while True:
            m = [[self.a[i][j] for j in free] for i in free]
            v = []
            for r, i in enumerate(free):
                ridge = self.prior_weight * (scale[i] if self.seen[i] else 1.0)
                m[r][r] += ridge
                v.append(self.b[i] + ridge * self.prior[i])
            sol = _solve(m, v)
            theta = [0.0] * N_TERMS
            for r, i in enumerate(free):
                theta[i] = sol[r]
            negative = [i for i in free if i != 0 and theta[i] < 0]
            if not negative:
                return theta
            pinned.update(negative)
            free = [i for i in free if i not in pinned]


def _bucket(bs: int) -> int:
    return max(0, int(bs).bit_length() - 1)  # 1 | 2-3 | 4-7 | 8-15 | ...


def _default_prior(shape: SpecShape, bs: int, seconds: float) -> tuple[float, ...]:
    """A rough theta from one step: a plain step per request costs what this one did; every extra verify row a
    request's step too (pessimistic, as a compute-bound verify); a drafter pass half a step; a tree's own work one
    more row."""
    rows = shape.nodes + (0.5 if shape.nodes > 1 else 0.0) + (0.0 if shape.is_chain else 1.0)
    per = seconds / (bs * rows)
    return (0.0, per, per, 0.0, 0.5 * per, per)


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (<= 6 unknowns: no numerics library needed in core)."""
    n = len(v)
    m = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            continue
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))
        x[r] = s / m[r][r] if abs(m[r][r]) >= 1e-300 else 0.0
    return x


@dataclass
class Decision:
    shape: SpecShape
    reason: str  # "warmup" | "best" | "probe" (a longer chain) | "reprice" (a plain step while drafting is best)
    predicted_tps: float | None = None  # the chosen shape's predicted committed tokens / s (None in warm-up)


class GoodputController:
    """`choose(bs)` before a decode step, `observe(...)` after it (its accepted lengths, the drafter's ranks of the
    committed tokens where the step drafted and, when known, its wall seconds). One controller per server process
    (per TP rank 0; the shape is broadcast with the accept decision)."""

    def __init__(self, cfg: GoodputConfig) -> None:
        self.cfg = cfg
        self.lengths = cfg.chain_lengths()
        self.longest = self.lengths[-1]
        self.trees = cfg.trees()
        self.shapes = tuple(SpecShape(n, 1) for n in self.lengths) + self.trees  # every candidate
        depth = cfg.depth
        self.acceptance = AcceptanceModel(depth, cfg.accept_halflife, cfg.prior_rate, cfg.prior_strength,
                                          cfg.change_threshold, cfg.change_factor)
        self.ranks = RankModel(depth, max((s.topk for s in self.trees), default=1), cfg.rank_halflife)
        self.calibration = {k: Calibration(cfg.accept_halflife) for k in {s.topk for s in self.trees}}
        self.cost = CostModel(cfg.cost_halflife, cfg.prior_weight, cfg.cost_prior)
        middle = self.lengths[len(self.lengths) // 2]
        self._warmup = [n for n in (self.longest, 1, middle) for _ in range(cfg.warmup_per_shape)]
        if self.longest == 1:
            self._warmup = []
        self.credit = 0.0  # probe credit (seconds)
        self.steps = 0
        self._last_probe = -cfg.probe_gap  # the step count at the last probe
        self.probe_gap = cfg.probe_gap  # the current gap between probes (backs off while plain steps stay best)
        self._drafted_run = 0  # decisions in a row whose best shape drafted
        self._last_plain: dict[int, int] = {}  # batch-size bucket -> the step count at its last plain step
        self.counts: dict[SpecShape, int] = {}  # decode steps per shape
        self._timed: set[SpecShape] = set()  # shapes whose first timed step was seen (and left out of the fit)
        self.last: Decision | None = None
        self._tokens_s = 0.0  # forgotten sums for the measured committed tokens/s
        self._seconds_s = 0.0
        self._tree_e: dict[int, list[float]] | None = None  # top-k -> uncalibrated E(m, k), m = 1..max_nodes
        self._rates: list[float] | None = None  # acceptance by depth, until the next observation

    # ---------------------------------------------------------------- the decision
    def choose(self, bs: int) -> Decision:
        assert bs >= 1
        if self._warmup or not self.cost.ready:  # (no step time measured yet: keep drafting)
            n = self._warmup.pop(0) if self._warmup else self.longest
            return self._decide(SpecShape(n, 1), "warmup", None)
        best, best_g, _ = self.best(bs)
        self._back_off(best)
        if best.nodes > 1 and self._reprice_due(bs):
            # what a plain step loses: its time less the time the best shape takes for the bs tokens it commits
            extra = max(self.cost.predict(PLAIN, bs) - bs / best_g, 0.0)
            if self.credit >= extra:
                self.credit -= extra
                return self._decide(PLAIN, "reprice", self.goodput(PLAIN, bs))
        probe = self.probe_length(best, bs)
        if (probe > best.nodes and self.cfg.probe_fraction > 0 and self.steps - self._last_probe >= self.probe_gap
                and self.could_beat(probe, bs, best_g)):
            # what the probe loses: its time less the time the best shape takes to commit what the probe is expected
            # to (at low batch sizes a long chain costs about what the best tree does, yet commits less)
            extra = max(self.cost.predict(probe, bs) - bs * self.expected(SpecShape(probe, 1)) / best_g, 0.0)
            self.credit = min(self.credit, 1.5 * extra)  # no back-to-back probes after a long quiet spell
            if self.credit >= extra:
                self.credit -= extra
                self._last_probe = self.steps
                return self._decide(SpecShape(probe, 1), "probe", self.goodput(SpecShape(probe, 1), bs))
        return self._decide(best, "best", best_g)

    def _back_off(self, best: SpecShape) -> None:
        """The probe gap: doubled (to its cap) when the step just observed was a probe and a plain step is still best
        (the probe confirmed the floor); back to `probe_gap` when a probe makes a drafted shape best, or when drafted
        shapes have stayed best for `probe_gap` decisions in a row (a noisy estimate that flips for a step or two is
        not traffic that became predictable)."""
        after_probe = self.last is not None and self.last.reason == "probe"
        self._drafted_run = self._drafted_run + 1 if best.nodes > 1 else 0
        if best.nodes > 1 and (after_probe or self._drafted_run >= self.cfg.probe_gap):
            self.probe_gap = self.cfg.probe_gap
        elif best.nodes == 1 and after_probe:
            self.probe_gap = min(2 * self.probe_gap, self.cfg.probe_backoff * self.cfg.probe_gap)

    def _reprice_due(self, bs: int) -> bool:
        """Whether this batch-size bucket has gone reprice_gap decode steps without a plain step."""
        gap = self.cfg.reprice_gap
        return gap > 0 and self.steps - self._last_plain.get(_bucket(bs), 0) >= gap

    def could_beat(self, nodes: int, bs: int, goodput: float) -> bool:
        """Whether a chain of `nodes` could beat `goodput` if acceptance were at its optimistic rates."""
        rates = self.acceptance.optimistic_rates(self.cfg.probe_z)
        return bs * expected_tokens(rates, nodes) / self.cost.predict(nodes, bs) > goodput

    def probe_length(self, best: SpecShape, bs: int) -> int:
        """The longest chain predicted to cost at most probe_cost_ratio x the best step (at least 2 rows): at high
        batch sizes a compute-bound verify of the longest chain would be one very slow step for every user."""
        limit = self.cfg.probe_cost_ratio * self.cost.predict(best, bs)
        fits = [n for n in self.lengths if n >= 2 and self.cost.predict(n, bs) <= limit]
        return max(fits) if fits else min(2, self.longest)

    def best(self, bs: int) -> tuple[SpecShape, float, float]:
        """(shape, its predicted tokens/s, the plain step's) for a step over `bs` requests."""
        plain = self.goodput(SpecShape(1, 1), bs)
        best, best_g = SpecShape(1, 1), plain * (1 + self.cfg.margin)
        for shape in self.shapes[1:]:
            g = self.goodput(shape, bs)
            if g > best_g:
                best, best_g = shape, g
        return best, (plain if best.nodes == 1 else best_g), plain

    def expected(self, shape: SpecShape) -> float:
        """E(shape): committed tokens per request (a tree's calibrated by what trees of its top-k accepted)."""
        if shape.is_chain:
            if self._rates is None:  # (until the next observation: every chain of a decision reads them)
                self._rates = self.acceptance.rates()
            return expected_tokens(self._rates, shape.nodes)
        e = self._tree_expected()[shape.topk][shape.nodes - 1]
        return 1.0 + (e - 1.0) * self.calibration[shape.topk].ratio

    def goodput(self, shape: SpecShape | int, bs: int) -> float:
        shape = _shape(shape)
        return bs * self.expected(shape) / self.cost.predict(shape, bs)

    def _tree_expected(self) -> dict[int, list[float]]:
        if self._tree_e is None:  # (one best-first expansion per top-k, until the next observation)
            probs = self.ranks.probs(self.acceptance.rates())
            most = max(s.nodes for s in self.trees)
            self._tree_e = {k: tree_tokens(probs, most, k) for k in self.calibration}
        return self._tree_e

    @property
    def uses_ranks(self) -> bool:
        """Whether `observe` reads the drafter's ranks of the committed tokens (they price trees: none without)."""
        return bool(self.trees)

    def _decide(self, shape: SpecShape, reason: str, g: float | None) -> Decision:
        self.last = Decision(shape, reason, g)
        return self.last

    # ---------------------------------------------------------------- measurements
    def observe(self, shape: SpecShape | int, accepted: Sequence[int], seconds: float | None,
                ranks: Sequence[Sequence[int]] | None = None) -> None:
        """A finished step of `shape` (an int: a chain of that many rows): accepted drafts per request; the drafter's
        rank (1-based) of each committed token at depths 1, 2, ... per request where the step drafted and the worker
        measured them (else None); its wall seconds, or None when the interval is not this step's alone (a prefill
        ran in it, the first step after idle)."""
        shape = _shape(shape)
        bs = len(accepted)
        if bs == 0:
            return
        self.steps += 1
        self.counts[shape] = self.counts.get(shape, 0) + 1
        if shape.nodes == 1:
            self._last_plain[_bucket(bs)] = self.steps
        if shape.is_chain:
            self.acceptance.observe(shape.nodes, accepted)
        else:  # calibrate against the prediction the step was chosen with; a tree's accepted length is not a chain's,
            # its rank-1 trials are
            self.calibration[shape.topk].observe(accepted, self._tree_expected()[shape.topk][shape.nodes - 1] - 1)
            self.acceptance.observe_counts(*rank_counts(self.cfg.depth, ranks or ()))
        if ranks is not None and self.uses_ranks:
            self.ranks.observe(ranks)
        self._tree_e = self._rates = None
        if seconds is None or seconds <= 0:
            return
        if shape not in self._timed:  # a shape's first step pays one-time costs (allocations, first calls): not its
            self._timed.add(shape)  # cost, and one such outlier would keep a good shape off for a long time
            return
        self.cost.observe(shape, bs, seconds)
        decay = 0.5 ** (1.0 / self.cfg.accept_halflife)
        self._tokens_s = self._tokens_s * decay + bs + sum(accepted)
        self._seconds_s = self._seconds_s * decay + seconds
        if self.last is not None and self.last.reason in ("probe", "reprice"):
            return  # a probe is paid from the credit when chosen
        self.credit += self.cfg.probe_fraction * seconds

    def steps_since(self, before: dict[SpecShape, int]) -> dict[str, int]:
        """Decode steps per shape label since `before` (a copy of `counts`): what one batch of a run chose."""
        shapes = sorted(self.counts, key=lambda s: (s.topk, s.nodes))
        return {label(s): self.counts[s] - before.get(s, 0) for s in shapes if self.counts[s] > before.get(s, 0)}

    @property
    def measured_tps(self) -> float:
        return self._tokens_s / self._seconds_s if self._seconds_s else 0.0

    def summary(self, bs: int) -> dict:
        """What the logs and metrics show: steps per shape ('4': a chain of 4 rows, '8x4': a tree of 8 nodes over
        top-4), acceptance by depth, the cost terms, predicted tokens/s of each candidate at batch size bs, and the
        measured committed tokens/s."""
        rates = self.acceptance.rates()
        out = {"steps": self.steps_since({}), "accept_rate": [round(r, 3) for r in rates[:8]],
               "measured_tps": round(self.measured_tps, 2), "changes": self.acceptance.changes}
        if self.trees:
            out["tree_calibration"] = {k: round(c.ratio, 3) for k, c in sorted(self.calibration.items())}
        if self.cost.ready:
            out["cost_ms"] = {k: round(1e3 * v, 3) for k, v in zip(TERMS, self.cost.theta())}
            out["predicted_tps"] = {label(s): round(self.goodput(s, bs), 2) for s in self.shapes}
            out["best"] = label(self.best(bs)[0])
        return out


def describe(summary: dict) -> str:
    """One log line from `summary`."""
    parts = [f"steps per shape {summary['steps']}", f"acceptance by depth {summary['accept_rate']}",
             f"measured {summary['measured_tps']} tok/s"]
    if "predicted_tps" in summary:
        best = summary["best"]
        parts.append(f"best shape {best} ({summary['predicted_tps'][best]} tok/s predicted; plain "
                     f"{summary['predicted_tps']['1']})")
        parts.append("cost ms " + ", ".join(f"{k} {v}" for k, v in summary["cost_ms"].items()))
    if "tree_calibration" in summary:
        parts.append(f"tree calibration {summary['tree_calibration']}")
    return "; ".join(parts)
