"""core/shape/goodput.py: the controller's models, and its decisions in a simulated server with a fake clock.

The simulated server has a known step cost T(n, bs) and per-depth acceptance; each step draws accepted drafts for
every request (leading successes, depth d accepted with probability a_d) and advances a fake clock by T (with
noise). The controller sees only what a worker sees: its choice, the accepted lengths and the step's seconds.
"""
from __future__ import annotations

import random

import pytest

from dflash_sglang.core.shape.acceptance import AcceptanceModel, expected_tokens
from dflash_sglang.core.shape.adaptive import SpecShape
from dflash_sglang.core.shape.goodput import CostModel, FixedStepCost, GoodputConfig, GoodputController

# A CPU-like cost (seconds): verify rows cost in full (compute-bound), a drafter pass ~ 0.7 plain steps at bs 1, a
# tree's own work (top-k, build, mask) a row and a half per request.
CPU_THETA = (0.002, 0.032, 0.004, 0.020, 0.004, 0.006)


def step_cost(theta, nodes, bs: int) -> float:
    return FixedStepCost(theta).seconds(nodes, bs)


def test_fixed_step_cost_is_theta_dot_the_terms():
    """Terms: step, per request, extra verify rows, drafter pass, drafter per request, tree per request."""
    cost = FixedStepCost.parse("1,2,3,4,5,6")
    assert cost.seconds(1, 5) == 1 + 2 * 5  # a plain step: no drafter pass
    assert cost.seconds(4, 3) == 1 + 2 * 3 + 3 * 3 * 3 + 4 + 5 * 3
    assert cost.seconds(SpecShape(8, 2), 2) == 1 + 2 * 2 + 3 * 2 * 7 + 4 + 5 * 2 + 6 * 2
    for bad in ("1,2,3", "1,2,3,4,5,x", "1,2,3,4,5,-1", "0,0,1,1,1,1", "1,2,3,4,5,nan", "1,2,3,4,5,inf"):
        with pytest.raises(ValueError, match="seconds|could not convert"):
            FixedStepCost.parse(bad)


def draw_accepted(rng: random.Random, rates, nodes: int, bs: int) -> list[int]:
    out = []
    for _ in range(bs):
        a = 0
        while a < nodes - 1 and rng.random() < rates[a]:
            a += 1
        out.append(a)
    return out


def simulate(ctrl: GoodputController, rates_at, steps: int, bs: int, theta=CPU_THETA, noise: float = 0.05,
             seed: int = 0) -> tuple[float, list[int], list[str]]:
    """Run `steps` decode steps; rates_at(step) gives the acceptance by depth. Returns (committed tokens / s,
    chosen chain lengths, reasons)."""
    rng = random.Random(seed)
    tokens, clock, chosen, reasons = 0, 0.0, [], []
    for i in range(steps):
        d = ctrl.choose(bs)
        n = d.shape.nodes
        accepted = draw_accepted(rng, rates_at(i), n, bs)
        seconds = step_cost(theta, n, bs) * (1 + noise * (2 * rng.random() - 1))
        ctrl.observe(n, accepted, seconds)
        tokens += bs + sum(accepted)
        clock += seconds
        chosen.append(n)
        reasons.append(d.reason)
    return tokens / clock, chosen, reasons


def oracle_tps(rates, bs: int, theta=CPU_THETA, lengths=(1, 2, 3, 4, 6, 8, 12, 16)) -> tuple[int, float]:
    best = max(lengths, key=lambda n: bs * expected_tokens(rates, n) / step_cost(theta, n, bs))
    return best, bs * expected_tokens(rates, best) / step_cost(theta, best, bs)


def test_expected_tokens_is_the_chain_formula():
    assert expected_tokens([0.5] * 15, 1) == 1.0
    assert expected_tokens([0.5] * 15, 3) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0, 0.0, 1.0], 4) == 2.0


def test_acceptance_counts_trials_only_where_every_earlier_draft_was_accepted():
    m = AcceptanceModel(depth=4, halflife=1e9, prior_rate=0.5, prior_strength=0.0)
    m.observe(5, [0, 2, 4])  # request 0: depth 1 tried, rejected; 1: depths 1,2 hit, 3 missed; 2: all four hit
    assert m.trials == [3, 2, 2, 1]
    assert m.hits == [2, 2, 1, 1]
    assert m.rates() == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    m.observe(2, [1])  # a chain of 2 only tests depth 1
    assert m.trials == pytest.approx([4, 2, 2, 1])


def test_acceptance_forgets_with_its_halflife():
    m = AcceptanceModel(depth=1, halflife=1.0, prior_rate=0.5, prior_strength=0.0)
    m.observe(2, [1])
    m.observe(2, [0])  # the older observation now counts half
    assert m.hits == [0.5] and m.trials == [1.5]


def test_cost_model_recovers_a_linear_cost():
    model = CostModel(halflife=1e9, prior_weight=1e-6)
    for bs in (1, 3, 8, 16):
        for shape in (1, 2, 4, 8, 16, SpecShape(8, 4), SpecShape(16, 2)):
            model.observe(shape, bs, step_cost(CPU_THETA, shape, bs))
    assert model.theta() == pytest.approx(CPU_THETA, rel=1e-3, abs=1e-5)


def test_noisy_cost_fit_keeps_every_coefficient_but_the_fixed_one_nonnegative():
    rng = random.Random(3)
    model = CostModel(halflife=50, prior_weight=0.1)
    theta = (0.010, 0.030, 0.0, 0.0, 0.0, 0.0)  # extra rows and drafting free: noise pulls their fit both ways
    for i in range(400):
        n, bs = rng.choice((1, 2, 16)), rng.choice((1, 2))
        model.observe(n, bs, step_cost(theta, n, bs) * (1 + 0.3 * (rng.random() - 0.5)))
        assert all(t >= 0 for t in model.theta()[1:])
    assert model.predict(16, 1) >= model.predict(2, 1) >= model.predict(1, 1) * 0.999


def test_weak_drafter_turns_speculation_off_and_costs_at_most_the_probe_budget():
    ctrl = GoodputController(GoodputConfig(max_nodes=16))
    rates = [0.35] * 15
    tps, chosen, reasons = simulate(ctrl, lambda i: rates, steps=1500, bs=1)
    plain = 1 / step_cost(CPU_THETA, 1, 1)
    assert oracle_tps(rates, 1)[0] == 1
    assert chosen[-200:].count(1) >= 180  # plain steps, with the odd probe
    assert 0 < reasons.count("probe") <= 0.05 * len(reasons)
    assert tps >= 0.95 * plain  # never slower than not speculating (warm-up and probes included)


@pytest.mark.parametrize("bs", [1, 4])
def test_good_drafter_gets_long_chains_and_beats_plain(bs):
    ctrl = GoodputController(GoodputConfig(max_nodes=16))
    rates = [0.9] * 15
    tps, chosen, reasons = simulate(ctrl, lambda i: rates, steps=600, bs=bs)
    best, oracle = oracle_tps(rates, bs)
    assert best >= 6
    drafted = [n for n, r in zip(chosen, reasons) if r != "reprice"]  # (a plain step re-priced now and then)
    assert min(drafted[-100:]) >= 4
    assert 1 <= reasons[-200:].count("reprice") <= 4
    assert tps >= 0.9 * oracle and tps > 1.3 * bs / step_cost(CPU_THETA, 1, bs)


def test_compute_bound_batch_prefers_short_chains():
    ctrl = GoodputController(GoodputConfig(max_nodes=16))
    rates = [0.6] * 15
    _, chosen, _ = simulate(ctrl, lambda i: rates, steps=600, bs=64)
    best, _ = oracle_tps(rates, 64)
    recent = chosen[-100:]
    assert max(set(recent), key=recent.count) == best
    # probes included: no step costs much more than the best one (a 16-row verify of 64 requests would)
    assert max(step_cost(CPU_THETA, n, 64) for n in recent) <= 4.2 * step_cost(CPU_THETA, best, 64)


def test_it_reacts_when_traffic_becomes_predictable_and_back():
    ctrl = GoodputController(GoodputConfig(max_nodes=16))
    weak, strong = [0.3] * 15, [0.92] * 15

    def rates_at(i):
        return strong if 1000 <= i < 2000 else weak

    _, chosen, _ = simulate(ctrl, rates_at, steps=3000, bs=1)
    assert chosen[800:1000].count(1) >= 180  # plain while drafts are bad
    switch_on = next(i for i in range(1000, 2000) if all(n >= 6 for n in chosen[i:i + 20]))
    assert switch_on < 1300  # found by probes within a few hundred steps
    assert chosen[2300:2500].count(1) >= 180  # back to plain once drafts are bad again


def test_the_floor_backs_its_probes_off_while_plain_stays_best():
    """With a drafter that never pays, each probe that leaves plain best doubles the gap to the next, up to
    probe_backoff x probe_gap: fewer than half the probes of a fixed gap (a probe that draws lucky acceptance makes
    drafting best for a while and resets the gap, as it should), throughput at plain's; a drafted best resets it."""
    rates = [0.35] * 15

    def run(backoff: int) -> tuple[float, list[int], GoodputController]:
        ctrl = GoodputController(GoodputConfig(max_nodes=16, probe_backoff=backoff))
        tps, _, reasons = simulate(ctrl, lambda i: rates, steps=4000, bs=1)
        return tps, [i for i, r in enumerate(reasons) if r == "probe"], ctrl

    tps, probes, ctrl = run(32)
    fixed_tps, fixed_probes, _ = run(1)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) <= len(fixed_probes) / 2, (len(probes), len(fixed_probes))
    assert max(gaps) == 32 * 12 and max(b - a for a, b in zip(fixed_probes, fixed_probes[1:])) < 2 * 12 * 4
    assert tps >= fixed_tps and tps >= 0.98 / step_cost(CPU_THETA, 1, 1)  # the floor is plain decoding
    while ctrl.probe_gap < 32 * 12:  # (a lucky probe may have reset it just now)
        ctrl.choose(1)
        ctrl.observe(ctrl.last.shape.nodes, [0] * 1, step_cost(CPU_THETA, ctrl.last.shape.nodes, 1))
    ctrl.acceptance = GoodputController(GoodputConfig(max_nodes=16, prior_rate=0.95, prior_strength=1e6)).acceptance
    for _ in range(11):  # drafting pays now (a drafted shape best): a flip of a few steps keeps the gap ...
        ctrl.choose(1)
    assert ctrl.probe_gap == 32 * 12
    ctrl.choose(1)  # ... twelve in a row reset it
    assert ctrl.probe_gap == 12


def test_config_checks():
    with pytest.raises(ValueError, match="max_nodes"):
        GoodputConfig(max_nodes=0)
    with pytest.raises(ValueError, match="cost_prior"):
        GoodputConfig(max_nodes=4, cost_prior=(1.0,))
    with pytest.raises(ValueError, match="probe_backoff"):
        GoodputConfig(max_nodes=4, probe_backoff=0)
    assert GoodputConfig(max_nodes=5).chain_lengths() == (1, 2, 3, 4, 5)
    ctrl = GoodputController(GoodputConfig(max_nodes=1))
    assert ctrl.choose(3).shape.nodes == 1


def test_probes_stop_where_even_optimistic_acceptance_cannot_pay():
    """A probe over 64 requests measures acceptance well: while a chain could not win even at the estimate plus two
    standard errors, the credit is not spent on it, so the same run probes less than with unbounded optimism."""
    rates = [0.2] * 15

    def probes(z: float) -> int:  # (no back-off: z alone)
        ctrl = GoodputController(GoodputConfig(max_nodes=16, probe_z=z, probe_backoff=1))
        _, _, reasons = simulate(ctrl, lambda i: rates, steps=1500, bs=64)
        return reasons[300:].count("probe")

    assert probes(2.0) < 0.8 * probes(1e6)


def test_a_measured_shape_keeps_its_own_cost_when_kernels_are_not_linear_in_the_rows():
    """Measured on the AVX-512 EPYC at bs 1 (ms per step): 2- and 3-row verifies are slower than 6- and 16-row ones
    would be on a line through them. The controller must still find the long chain that pays."""
    table = {1: 0.076, 2: 0.147, 3: 0.180, 4: 0.150, 6: 0.145, 8: 0.155, 12: 0.172, 16: 0.191}
    rng = random.Random(5)
    rates = [0.8] * 15
    ctrl = GoodputController(GoodputConfig(max_nodes=16))
    tokens = clock = 0.0
    chosen = []
    for _ in range(800):
        decision = ctrl.choose(1)
        n = decision.shape.nodes
        accepted = draw_accepted(rng, rates, n, 1)
        seconds = table[n] * (1 + 0.05 * (2 * rng.random() - 1))
        ctrl.observe(n, accepted, seconds)
        tokens, clock = tokens + 1 + sum(accepted), clock + seconds
        if decision.reason != "reprice":  # (a plain step re-priced now and then)
            chosen.append(n)
    oracle = max(expected_tokens(rates, n) / t for n, t in table.items())
    assert tokens / clock >= 0.85 * oracle and min(chosen[-100:]) >= 6, chosen[-100:]


@pytest.mark.parametrize("bs", [1, 8, 64])
def test_a_drop_in_acceptance_is_detected_and_drafting_stops_within_a_few_steps(bs):
    """After a long predictable spell (long chains chosen) the drafts turn bad: the change detector restarts the
    acceptance estimate, so plain steps return within tens of steps, not the 100-200 of the 64-step memory alone."""
    strong, weak = [0.92] * 15, [0.15] * 15

    def steps_to_plain(threshold: float) -> tuple[int, int]:
        ctrl = GoodputController(GoodputConfig(max_nodes=16, change_threshold=threshold))
        _, chosen, reasons = simulate(ctrl, lambda i: strong if i < 1000 else weak, steps=1400, bs=bs)
        # long chains while drafts were good (but a plain step re-priced now and then)
        assert min(n for n, r in zip(chosen[900:1000], reasons[900:1000]) if r != "reprice") >= 6
        off = next(i for i in range(1000, 1400) if all(n == 1 for n in chosen[i:i + 10]))
        return off - 1000, ctrl.acceptance.changes

    detected, changes = steps_to_plain(GoodputConfig(max_nodes=16).change_threshold)
    slow, no_changes = steps_to_plain(0.0)
    assert changes >= 1 and no_changes == 0
    assert detected <= 20 and slow >= 5 * detected, (detected, slow)


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.8, 0.9])
@pytest.mark.parametrize("bs", [1, 16])
def test_steady_traffic_loses_nothing_to_the_change_detector(rate, bs):
    """In 2000 steps of a fixed acceptance the detector restarts the estimate rarely (a run of misses at bs 1 looks
    like a drop), and the committed tokens/s stay those of the controller without it."""
    def run(threshold: float) -> tuple[float, int]:
        ctrl = GoodputController(GoodputConfig(max_nodes=16, change_threshold=threshold))
        tps, _, _ = simulate(ctrl, lambda i: [rate] * 15, steps=2000, bs=bs, seed=3)
        return tps, ctrl.acceptance.changes

    (tps, changes), (tps_without, _) = run(GoodputConfig(max_nodes=16).change_threshold), run(0.0)
    assert changes <= 10 and tps >= 0.98 * tps_without, (changes, tps, tps_without)


def test_plain_steps_are_repriced_while_a_long_chain_is_best():
    """A load spike that makes every extra verify row expensive (a compute-bound verify) turns a long chain slower than
    plain decoding. Fitted over that chain's steps alone, the per-request and per-row costs grow together and cannot be
    told apart, so the plain step's price must be measured again: re-priced plain steps (reason "reprice") bring the
    controller back to plain within a few hundred steps; without them (reprice_gap 0) it stays on the chain."""
    rates, bs, spike = [0.9] * 15, 4, 600
    light = (0.002, 0.032, 0.001, 0.010, 0.002, 0.006)
    heavy = (0.002, 0.032, 0.060, 0.010, 0.002, 0.006)  # each extra verify row now costs ~2 plain steps' rows

    def run(gap: int) -> tuple[list[int], list[str]]:
        ctrl = GoodputController(GoodputConfig(max_nodes=16, reprice_gap=gap))
        simulate(ctrl, lambda i: rates, steps=spike, bs=bs, theta=light)
        assert ctrl.last.shape.nodes >= 8  # drafting pays before the spike
        _, chosen, reasons = simulate(ctrl, lambda i: rates, steps=1200, bs=bs, theta=heavy, seed=1)
        return chosen, reasons

    chosen, reasons = run(64)
    back = next(i for i in range(len(chosen)) if all(n == 1 for n in chosen[i:i + 20]))
    assert back < 200  # plain again within a few reprices (a chain of 16 now costs 3.5x a plain step's tokens)
    assert chosen[-300:].count(1) >= 270  # and it stays there (the odd probe of a chain remains)
    assert 0 < reasons.count("reprice") <= 0.05 * len(reasons)
    stuck, _ = run(0)
    assert stuck[-300:].count(1) < 30  # the old behaviour: still drafting long chains
