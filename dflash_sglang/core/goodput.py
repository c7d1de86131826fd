"""Goodput controller: each decode step's verify shape from acceptance and step cost measured online.

Speculation pays only when the tokens a step commits outweigh what drafting and verifying cost on this hardware,
for this drafter, on this traffic. For a chain of n verify rows (the bonus token and n-1 drafts; n = 1 is a plain
decoding step with no drafter pass) at batch size bs the controller predicts the batch's committed tokens per second

    G(n, bs) = bs * E(n) / T(n, bs)
    E(n)     = 1 + sum_{k=1}^{n-1} prod_{d=1}^{k} a_d          (a_d: acceptance at draft depth d, given depth d-1)
    T(n, bs) = theta . [1, bs, bs * (n - 1), drafts, drafts * bs]    (drafts = 1 if n > 1)

and verifies the n of the largest G (SmartSpec's goodput, arXiv 2406.14066, over DFlash chains). Acceptance a_d
comes from the steps' accepted lengths (exponentially forgotten counts, a Beta prior); theta from the steps' wall
times (exponentially forgotten least squares, ridge toward a prior, coefficients kept >= 0 so a noisy fit can
never make a longer chain look cheaper than a shorter one). The cost model's terms: a fixed per-step cost, a
per-request cost (a plain step), each extra verify row per request (compute-bound verifies pay it in full,
memory-bound ones little), and the drafter pass (fixed + per request).

Acceptance is forgotten slowly (`accept_halflife` steps), which keeps the estimate steady, but a change of traffic
(new prompts, a predictable request finishing) would then be followed tens to hundreds of steps late. A change
detector catches it: CUSUMs (Page, 1954) of the log-likelihood ratio of each step's accepted drafts, for every
depth's acceptance rate dropping by `change_factor` against staying at the estimate, and for its rejection rate
dropping so (a rise); past `change_threshold` the estimate restarts from the counts of the steps since that CUSUM
last left zero (its estimate of when the change happened), so nothing of the old regime is kept. At one request a
step tests one or two drafts, and a regime change is caught in about ten steps (the forgetting alone took about a
hundred).

Exploration is bounded. Warm-up runs one step each of the longest chain, a plain step and a middle chain
(`warmup_per_shape` of each; a shape's first timed step is left out of the cost fit) to seed both models. After
that, whatever the best shape is, a probe credit of `probe_fraction` of the measured time accrues; when it covers a
probe's predicted extra cost, one step runs a long chain (the longest whose predicted cost stays within
`probe_cost_ratio` of the best step's: it measures acceptance at every depth it reaches) and the credit pays for it,
provided that chain could still beat the best step at acceptance `probe_z` standard errors above its estimate (a
large batch's probe measures many requests at once: once drafting is known not to pay there, probes wait until those
counts fade). So with speculation off the controller spends at most about `probe_fraction` of the time re-checking
whether traffic became predictable, and turns speculation back on when it did.

Pure logic: no torch, no clock of its own (the caller passes measured seconds), deterministic, so tests drive it
with a fake clock. The SGLang worker and the reference decoder both use it (docs/structure.md, "One decode step").
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .adaptive import SpecShape

N_TERMS = 5  # [1, bs, bs*(n-1), drafts, drafts*bs]
TERMS = ("step", "per_request", "per_extra_row", "draft_pass", "draft_per_request")


@dataclass(frozen=True)
class GoodputConfig:
    max_nodes: int  # the longest chain (the drafter block, or less)
    candidates: tuple[int, ...] = ()  # chain lengths to choose among (1 = plain); () = 1, 2, 3, 4, 6, 8, 12, 16, ...
    probe_fraction: float = 0.03  # time share spent on probes of the longest chain while it is not chosen
    accept_halflife: float = 64.0  # decode steps after which an acceptance observation counts half
    # The change detector: CUSUMs of each step's acceptance log-likelihood ratio, for the rates dropping by
    # change_factor and for the rejection rates dropping by it (a rise); past change_threshold (0 = never) the
    # estimate restarts from the steps since that CUSUM last left zero.
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
    probe_cost_ratio: float = 4.0  # a probe is the longest chain predicted to cost at most this x the best step
    probe_z: float = 2.0  # ... and runs only if, at acceptance this many standard errors above the estimate, it
    # could beat the best step (a large batch's probe measures a lot: once that is known, probes stop until the
    # counts fade)

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if not 0 <= self.probe_fraction < 1:
            raise ValueError(f"probe_fraction must be in [0, 1), got {self.probe_fraction}")
        if self.cost_prior is not None and len(self.cost_prior) != N_TERMS:
            raise ValueError(f"cost_prior needs {N_TERMS} terms {TERMS}, got {len(self.cost_prior)}")

    def chain_lengths(self) -> tuple[int, ...]:
        base = self.candidates or (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
        lengths = sorted({min(n, self.max_nodes) for n in base if n >= 1} | {1, self.max_nodes})
        return tuple(lengths)


def features(nodes: int, bs: int) -> tuple[float, ...]:
    """The cost model's terms for a chain of `nodes` verify rows per request over `bs` requests."""
    draft = 1.0 if nodes > 1 else 0.0
    return (1.0, float(bs), float(bs * (nodes - 1)), draft, draft * bs)


def expected_tokens(rates: Sequence[float], nodes: int) -> float:
    """E(n): committed tokens per request of a chain of `nodes` rows (rates[d-1] = a_d)."""
    total, p = 1.0, 1.0
    for d in range(1, nodes):
        p *= rates[d - 1]
        total += p
    return total


@dataclass
class AcceptanceModel:
    """Per-depth conditional acceptance from accepted lengths, exponentially forgotten, Beta prior."""

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
        """One decode step of a chain of `nodes` rows (plain steps too: what is known fades with every step, so
        after a long spell of plain steps the few recent probes outweigh the stale regime); accepted: drafts
        accepted per request (0..nodes-1)."""
        step_trials, step_hits = [0.0] * self.depth, [0.0] * self.depth
        for a in accepted:
            assert 0 <= a <= nodes - 1, (a, nodes)
            for d in range(min(a + 1, nodes - 1)):  # depth d+1 was tried (all before it accepted) ...
                step_trials[d] += 1.0
                if a > d:  # ... and accepted
                    step_hits[d] += 1.0
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
class CostModel:
    """Step seconds as theta . features, by exponentially forgotten least squares with a ridge prior; theta >= 0
    except the fixed term (projected: a coefficient the fit drives negative is pinned to 0 and the rest refitted)."""

    halflife: float
    prior_weight: float
    prior: tuple[float, ...] | None = None
    a: list[list[float]] = field(init=False)  # sum w phi phi^T
    b: list[float] = field(init=False)  # sum w phi y
    seen: list[float] = field(init=False)  # per term: forgotten count of steps that had it nonzero
    measured: dict[tuple[int, int], tuple[float, float, float]] = field(default_factory=dict)  # (chain length,
    # batch-size bucket) -> (mean seconds, mean bs, forgotten weight)
    _theta: list[float] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.a = [[0.0] * N_TERMS for _ in range(N_TERMS)]
        self.b = [0.0] * N_TERMS
        self.seen = [0.0] * N_TERMS

    def observe(self, nodes: int, bs: int, seconds: float) -> None:
        decay = 0.5 ** (1.0 / self.halflife)
        for key, (m, b, w) in list(self.measured.items()):  # every shape's measurements fade alike
            self.measured[key] = (m, b, w * decay)
        m, b, w = self.measured.get((nodes, _bucket(bs)), (0.0, 0.0, 0.0))
        w += 1.0
        self.measured[(nodes, _bucket(bs))] = (m + (seconds - m) / w, b + (bs - b) / w, w)
        phi = features(nodes, bs)
        for i in range(N_TERMS):
            self.b[i] = self.b[i] * decay + phi[i] * seconds
            self.seen[i] = self.seen[i] * decay + (1.0 if phi[i] else 0.0)
            for j in range(N_TERMS):
                self.a[i][j] = self.a[i][j] * decay + phi[i] * phi[j]
        if self.prior is None:  # the first plain or drafted step sets a rough prior (see _default_prior)
            self.prior = _default_prior(nodes, bs, seconds)
        self._theta = None

    @property
    def ready(self) -> bool:
        return self.prior is not None

    def theta(self) -> list[float]:
        if self._theta is None:
            self._theta = self._fit()
        return self._theta

    def linear(self, nodes: int, bs: int) -> float:
        theta = self.theta()
        return max(1e-9, sum(t * f for t, f in zip(theta, features(nodes, bs))))

    def predict(self, nodes: int, bs: int) -> float:
        """A shape measured at a similar batch size (the same power-of-two bucket) costs what it measured (scaled by
        the linear model to this bs); others what the linear model says. Real kernels are not linear in the rows: on
        the AVX-512 EPYC a 3-row verify step took longer than a 6-row one."""
        seen = self.measured.get((nodes, _bucket(bs)))
        if seen is None or seen[2] < 0.5:
            return self.linear(nodes, bs)
        mean_s, mean_bs, _ = seen
        return mean_s * self.linear(nodes, bs) / self.linear(nodes, max(1, round(mean_bs)))

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


def _fade_add(counts: list[float], new: list[float], halflife: float) -> list[float]:
    decay = 0.5 ** (1.0 / halflife)
    return [c * decay + x for c, x in zip(counts, new)]


def _bucket(bs: int) -> int:
    return max(0, int(bs).bit_length() - 1)  # 1 | 2-3 | 4-7 | 8-15 | ...


def _default_prior(nodes: int, bs: int, seconds: float) -> tuple[float, ...]:
    """A rough theta from one step: a plain step per request costs what this one did; every extra verify row a
    request's step too (pessimistic, as a compute-bound verify); a drafter pass half a step."""
    per = seconds / (bs * (1 + (nodes - 1) + (0.5 if nodes > 1 else 0.0)))
    return (0.0, per, per, 0.0, 0.5 * per)


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (<= 5 unknowns: no numerics library needed in core)."""
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
    reason: str  # "warmup" | "best" | "probe"
    predicted_tps: float | None = None  # the chosen shape's predicted committed tokens / s (None in warm-up)


class GoodputController:
    """`choose(bs)` before a decode step, `observe(...)` after it (its accepted lengths and, when known, its wall
    seconds). One controller per server process (per TP rank 0; the shape is broadcast with the accept decision)."""

    def __init__(self, cfg: GoodputConfig) -> None:
        self.cfg = cfg
        self.lengths = cfg.chain_lengths()
        self.longest = self.lengths[-1]
        self.acceptance = AcceptanceModel(max(1, self.longest - 1), cfg.accept_halflife, cfg.prior_rate,
                                          cfg.prior_strength, cfg.change_threshold, cfg.change_factor)
        self.cost = CostModel(cfg.cost_halflife, cfg.prior_weight, cfg.cost_prior)
        middle = self.lengths[len(self.lengths) // 2]
        self._warmup = [n for n in (self.longest, 1, middle) for _ in range(cfg.warmup_per_shape)]
        if self.longest == 1:
            self._warmup = []
        self.credit = 0.0  # probe credit (seconds)
        self.steps = 0
        self.counts: dict[int, int] = {}  # decode steps per chain length
        self._timed: set[int] = set()  # chain lengths whose first timed step was seen (and left out of the fit)
        self.last: Decision | None = None
        self._tokens_s = 0.0  # forgotten sums for the measured committed tokens/s
        self._seconds_s = 0.0

    # ---------------------------------------------------------------- the decision
    def choose(self, bs: int) -> Decision:
        assert bs >= 1
        if self._warmup or not self.cost.ready:  # (no step time measured yet: keep drafting)
            n = self._warmup.pop(0) if self._warmup else self.longest
            return self._decide(n, "warmup", None)
        best, best_g, _ = self.best(bs)
        probe = self.probe_length(best, bs)
        if probe > best and self.cfg.probe_fraction > 0 and self.could_beat(probe, bs, best_g):
            extra = max(self.cost.predict(probe, bs) - self.cost.predict(best, bs), 0.0)
            self.credit = min(self.credit, 1.5 * extra)  # no back-to-back probes after a long quiet spell
            if self.credit >= extra:
                self.credit -= extra
                return self._decide(probe, "probe", self.goodput(probe, bs))
        return self._decide(best, "best", best_g)

    def could_beat(self, nodes: int, bs: int, goodput: float) -> bool:
        """Whether a chain of `nodes` could beat `goodput` if acceptance were at its optimistic rates."""
        rates = self.acceptance.optimistic_rates(self.cfg.probe_z)
        return bs * expected_tokens(rates, nodes) / self.cost.predict(nodes, bs) > goodput

    def probe_length(self, best: int, bs: int) -> int:
        """The longest chain predicted to cost at most probe_cost_ratio x the best step (at least 2 rows): at high
        batch sizes a compute-bound verify of the longest chain would be one very slow step for every user."""
        limit = self.cfg.probe_cost_ratio * self.cost.predict(best, bs)
        fits = [n for n in self.lengths if n >= 2 and self.cost.predict(n, bs) <= limit]
        return max(fits) if fits else min(2, self.longest)

    def best(self, bs: int) -> tuple[int, float, float]:
        """(chain length, its predicted tokens/s, the plain step's) for a step over `bs` requests."""
        plain = self.goodput(1, bs)
        best, best_g = 1, plain * (1 + self.cfg.margin)
        for n in self.lengths[1:]:
            g = self.goodput(n, bs)
            if g > best_g:
                best, best_g = n, g
        return best, (plain if best == 1 else best_g), plain

    def goodput(self, nodes: int, bs: int) -> float:
        return bs * expected_tokens(self.acceptance.rates(), nodes) / self.cost.predict(nodes, bs)

    def _decide(self, n: int, reason: str, g: float | None) -> Decision:
        self.last = Decision(SpecShape(n, 1), reason, g)
        return self.last

    # ---------------------------------------------------------------- measurements
    def observe(self, nodes: int, accepted: Sequence[int], seconds: float | None) -> None:
        """A finished step of a chain of `nodes` rows: accepted drafts per request; its wall seconds, or None when
        the interval is not this step's alone (a prefill ran in it, the first step after idle)."""
        bs = len(accepted)
        if bs == 0:
            return
        self.steps += 1
        self.counts[nodes] = self.counts.get(nodes, 0) + 1
        self.acceptance.observe(nodes, accepted)
        if seconds is None or seconds <= 0:
            return
        if nodes not in self._timed:  # a shape's first step pays one-time costs (allocations, first calls): not its
            self._timed.add(nodes)  # cost, and one such outlier would keep a good shape off for a long time
            return
        self.cost.observe(nodes, bs, seconds)
        decay = 0.5 ** (1.0 / self.cfg.accept_halflife)
        self._tokens_s = self._tokens_s * decay + bs + sum(accepted)
        self._seconds_s = self._seconds_s * decay + seconds
        if self.last is not None and self.last.reason == "probe":
            return  # a probe is paid from the credit when chosen
        self.credit += self.cfg.probe_fraction * seconds

    @property
    def measured_tps(self) -> float:
        return self._tokens_s / self._seconds_s if self._seconds_s else 0.0

    def summary(self, bs: int) -> dict:
        """What the logs and metrics show: steps per chain length, acceptance by depth, the cost terms, predicted
        tokens/s of each candidate at batch size bs, and the measured committed tokens/s."""
        rates = self.acceptance.rates()
        out = {"steps": dict(sorted(self.counts.items())), "accept_rate": [round(r, 3) for r in rates[:8]],
               "measured_tps": round(self.measured_tps, 2), "changes": self.acceptance.changes}
        if self.cost.ready:
            out["cost_ms"] = {k: round(1e3 * v, 3) for k, v in zip(TERMS, self.cost.theta())}
            out["predicted_tps"] = {n: round(self.goodput(n, bs), 2) for n in self.lengths}
            out["best"] = self.best(bs)[0]
        return out


def describe(summary: dict) -> str:
    """One log line from `summary`."""
    parts = [f"steps per chain length {summary['steps']}", f"acceptance by depth {summary['accept_rate']}",
             f"measured {summary['measured_tps']} tok/s"]
    if "predicted_tps" in summary:
        best = summary["best"]
        parts.append(f"best chain {best} ({summary['predicted_tps'][best]} tok/s predicted; plain "
                     f"{summary['predicted_tps'][1]})")
        parts.append("cost ms " + ", ".join(f"{k} {v}" for k, v in summary["cost_ms"].items()))
    return "; ".join(parts)
