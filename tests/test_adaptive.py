import pytest
from sglang_support import requires_sglang

from dflash_sglang.core.shape.adaptive import DEFAULT_TABLE, AdaptivePolicy, SpecShape
from dflash_sglang.core.step.tree import max_tree_nodes


@pytest.mark.parametrize("budget", [None, 1, 7, 64, 300, 2048])
@pytest.mark.parametrize("max_depth", [None, 1, 3, 7, 15])
def test_never_exceeds_budget(budget, max_depth):
    policy = AdaptivePolicy.parse(DEFAULT_TABLE, token_budget=budget, max_depth=max_depth)
    for bs in range(1, 600):
        if budget is not None and bs > budget:
            with pytest.raises(ValueError, match="token budget"):
                policy.choose(bs)
            continue
        s = policy.choose(bs)
        assert s.nodes >= 1 and s.topk >= 1
        if budget is not None:
            assert bs * s.nodes <= budget
        if max_depth is not None:
            assert s.nodes <= (max_depth + 1 if s.is_chain else max_tree_nodes(max_depth, s.topk))


def test_default_shrinks_with_concurrency():
    policy = AdaptivePolicy.parse(DEFAULT_TABLE)
    sizes = [policy.choose(bs).nodes for bs in (1, 2, 4, 8, 16, 32, 64, 128, 512)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert policy.choose(1) == SpecShape(64, 4) and policy.choose(100).is_chain


def test_parse_errors():
    p = AdaptivePolicy.parse("2:8x2,inf:1x1")
    assert p.choose(2) == SpecShape(8, 2) and p.choose(3) == SpecShape(1, 1)
    for bad, match in [("8:16", "cannot parse row"), ("8:16x1", "end with 'inf'"), ("inf:4x1,8:2x1", "ascend"),
                       ("inf:2x2", "bad adaptive shape")]:
        with pytest.raises(ValueError, match=match):
            AdaptivePolicy.parse(bad)


def test_row_shapes_bound_every_choice():
    """row_shapes() (depth-capped rows) bounds what choose() returns for any batch size under any budget."""
    for depth in (1, 3, 7):
        for budget in (None, 48, 100):
            policy = AdaptivePolicy.parse("2:64x4,8:20x2,32:16x1,inf:1x1", token_budget=budget, max_depth=depth)
            rows = policy.row_shapes()
            assert max(s.nodes for s in rows) == min(64, max_tree_nodes(depth, 4))
            for bs in range(1, 49):
                s = policy.choose(bs)
                assert any(s.nodes <= r.nodes and (s.is_chain or s.topk == r.topk) for r in rows)


# ------------------------------------------------------------------ the SGLang worker's schedule
# (adapter/step/shapes.py)
TABLE_FLAG, BUDGET_FLAG = "--speculative-dflash-adaptive-table", "--speculative-dflash-adaptive-token-budget"


@requires_sglang
@pytest.mark.parametrize("table", [DEFAULT_TABLE, "8:10x3,16:6x1,inf:4x1", "1:64x4,inf:16x1", "inf:1x1",
                                   "4:200x2,inf:3x1"])
@pytest.mark.parametrize("budget", [None, 48, 64, 500])
@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_worker_steps_never_exceed_n_nor_the_budget(table, budget, block):
    """Every decode step's shape fits the stride / KV reservation N the server was configured with, the token
    budget, and the drafter block (chains <= B, trees <= the lattice of depth B-1)."""
    from dflash_sglang.adapter.step.shapes import ShapeSchedule, adaptive_limits

    max_running = 48
    policy, largest = adaptive_limits(table, budget, block, None, vocab_size=32000, max_running=max_running)
    schedule = ShapeSchedule(largest.nodes, policy=policy, table=table)
    for bs in list(range(1, max_running + 1)) * 2:
        s = schedule.choose(bs)
        assert 1 <= s.nodes <= largest.nodes and s.topk <= largest.topk
        assert budget is None or bs * s.nodes <= budget
        assert s.nodes <= (block if s.is_chain else max_tree_nodes(block - 1, s.topk))
    assert sum(schedule.steps.values()) == 2 * max_running
    # an explicit N at least the largest row is kept as the stride; the rows still fit it
    assert adaptive_limits(table, budget, block, largest.nodes + 3, 32000, max_running)[1].nodes == largest.nodes + 3


@requires_sglang
@pytest.mark.parametrize(
    "table, budget, flag, match",
    [
        ("8:16", None, TABLE_FLAG, "cannot parse row '8:16'"),
        ("8:16x1", None, TABLE_FLAG, "end with 'inf'"),
        ("inf:4x1,8:2x1", None, TABLE_FLAG, "ascend"),
        ("inf:2x2", None, TABLE_FLAG, "bad adaptive shape"),
        (DEFAULT_TABLE, "lots", BUDGET_FLAG, "positive integer"),
        (DEFAULT_TABLE, 0, BUDGET_FLAG, "positive integer"),
    ],
)
def test_malformed_settings_name_the_flag(table, budget, flag, match):
    from dflash_sglang.adapter.step.shapes import AdaptiveConfigError, adaptive_limits

    with pytest.raises(AdaptiveConfigError, match=match) as err:
        adaptive_limits(table, budget, 8, None, 100, 48)
    assert str(err.value).startswith(f"{flag} ") and "\n" not in str(err.value)


@requires_sglang
def test_limits_against_the_server_flags():
    from dflash_sglang.adapter.step.shapes import AdaptiveConfigError, adaptive_limits

    # N defaults to the largest row after the block cap: 64x4 fits a depth-7 lattice; with B = 3 the lattice
    # of depth 2 has 1 + 4 + 16 = 21 nodes
    assert adaptive_limits(DEFAULT_TABLE, None, 8, None, 100, 48)[1] == SpecShape(64, 4)
    assert adaptive_limits(DEFAULT_TABLE, None, 3, None, 100, 48)[1] == SpecShape(21, 4)
    with pytest.raises(AdaptiveConfigError, match=rf"^{TABLE_FLAG} '{DEFAULT_TABLE}' has a 64x4 row .* more than "
                                                  r"--speculative-num-draft-tokens 16"):
        adaptive_limits(DEFAULT_TABLE, None, 8, 16, 100, 48)
    with pytest.raises(AdaptiveConfigError, match=r"top-k 4 is larger than the draft vocabulary \(3 tokens\)"):
        adaptive_limits(DEFAULT_TABLE, None, 8, None, 3, 48)
    with pytest.raises(AdaptiveConfigError, match=rf"^{BUDGET_FLAG} 32 is below --max-running-requests 48"):
        adaptive_limits(DEFAULT_TABLE, 32, 8, None, 100, 48)


@requires_sglang
def test_schedule_logs_the_distribution_at_debug_on_change_only(caplog):
    import logging

    from dflash_sglang.adapter.step.shapes import ShapeSchedule, adaptive_limits

    policy, largest = adaptive_limits("2:6x2,inf:3x1", None, 4, None, 100, 8)
    schedule = ShapeSchedule(largest.nodes, policy=policy, table="2:6x2,inf:3x1")
    with caplog.at_level(logging.DEBUG, logger="dflash_sglang.adapter.step.shapes"):
        shapes = [schedule.choose(bs) for bs in (1, 1, 2, 5, 6, 7, 1)]
    assert shapes == [SpecShape(6, 2)] * 3 + [SpecShape(3, 1)] * 3 + [SpecShape(6, 2)]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(r.levelno == logging.DEBUG for r in caplog.records)
    assert lines[-1].endswith("-> 6x2; decode steps per shape so far: 6x2: 4, 3x1: 3")
    assert schedule.distribution() == "6x2: 4, 3x1: 3"


@requires_sglang
def test_fixed_schedule_is_the_flags_shape():
    from dflash_sglang.adapter.step.shapes import ShapeSchedule

    chain, tree = ShapeSchedule(8, fixed=SpecShape(8, 1)), ShapeSchedule(10, fixed=SpecShape(10, 3))
    assert [chain.choose(bs) for bs in (1, 64)] == [SpecShape(8, 1)] * 2 and not chain.steps
    assert tree.choose(3) == SpecShape(10, 3) and tree.describe() == "tree of 10 nodes (top-3)"


def test_chain_verify_rows_are_a_depth_i_tree():
    """The worker verifies a chain of n through build_tree_inputs with depth i at node i: the same ids, positions
    and KV slots as the first n columns of the block inputs."""
    import torch

    from dflash_sglang import ops
    from dflash_sglang.core.step.block import build_block_inputs

    req_to_token = torch.arange(5 * 40, dtype=torch.int32).reshape(5, 40).flip(1).contiguous()
    seq_lens, rows, bonus = torch.tensor([3, 0, 17]), torch.tensor([4, 0, 2]), torch.tensor([5, 6, 7])
    block = build_block_inputs(bonus, seq_lens, 8, 99, req_to_token, rows)
    for n in (1, 3, 8):
        ids = block.input_ids[:, :n]
        chain = ops.build_tree_inputs(ids, torch.arange(n).expand(3, n).contiguous(), seq_lens, req_to_token, rows)
        assert torch.equal(chain.positions, block.positions[:, :n])
        assert torch.equal(chain.out_cache_loc, block.out_cache_loc[:, :n])


@pytest.mark.parametrize("shape, cap, want", [
    (SpecShape(8, 1), 20, SpecShape(8, 1)), (SpecShape(8, 1), 3, SpecShape(3, 1)),
    (SpecShape(8, 1), 1, SpecShape(1, 1)), (SpecShape(16, 4), 5, SpecShape(5, 4)),
    (SpecShape(16, 4), 2, SpecShape(2, 1)), (SpecShape(10, 3), 10, SpecShape(10, 3)),
])
def test_shape_at_most(shape, cap, want):
    """The worker's cut near the context limit: at most `cap` verify tokens; a tree cut below 3 nodes is a chain."""
    assert shape.at_most(cap) == want


@requires_sglang
def test_goodput_schedule_publishes_the_controllers_state_as_metrics():
    """--enable-metrics: every decode step is counted under its shape's label, and the controller's choice,
    predicted / measured tokens/s, acceptance by depth and cost terms are published beside SGLang's spec metrics."""
    from prometheus_client import CollectorRegistry

    from dflash_sglang.adapter.step.metrics import GoodputMetrics
    from dflash_sglang.adapter.step.shapes import ShapeSchedule
    from dflash_sglang.core.shape.goodput import GoodputConfig, GoodputController

    registry = CollectorRegistry()
    labels = {"model_name": "m"}
    schedule = ShapeSchedule(8, controller=GoodputController(GoodputConfig(max_nodes=8, max_topk=4)),
                             metrics=GoodputMetrics(labels, registry=registry, every_s=0.0))
    shapes = []
    for _ in range(40):
        shape = schedule.choose(2)
        shapes.append(shape)
        drafts = min(shape.nodes - 1, 2)
        schedule.observe(shape, [drafts, 0], 0.01 * (1 + shape.nodes / 8),
                         [[1] * drafts + [2], [3]] if shape.nodes > 1 else None)

    def value(name, **extra):
        return registry.get_sample_value(f"sglang:dflash_{name}", {**labels, **extra})

    counted = {s: shapes.count(s) for s in set(shapes)}
    for shape, n in counted.items():
        name = str(shape.nodes) if shape.is_chain else f"{shape.nodes}x{shape.topk}"
        assert value("decode_steps_total", shape=name) == n
    assert (value("shape_nodes"), value("shape_topk")) == (shapes[-1].nodes, shapes[-1].topk)
    summary = schedule.controller.summary(2)
    assert value("goodput_predicted_tokens_per_second") == summary["predicted_tps"][summary["best"]] > 0
    assert value("goodput_plain_tokens_per_second") == summary["predicted_tps"]["1"]
    assert value("goodput_measured_tokens_per_second") == summary["measured_tps"] > 0
    assert value("goodput_accept_rate", depth="1") == summary["accept_rate"][0]
    assert value("goodput_step_cost_seconds", term="per_request") == pytest.approx(
        summary["cost_ms"]["per_request"] / 1e3)


@requires_sglang
def test_goodput_schedule_observes_a_fixed_step_cost_instead_of_wall_time():
    """DFLASH_SIMULATE_STEP_COST (adapter/simulate.py): each step reaches the controller as the fixed cost of its
    shape at its batch size; a step whose interval held other work (seconds None) still stays out of the cost fit."""
    from dflash_sglang.adapter.simulate import simulated_step_cost
    from dflash_sglang.adapter.step.shapes import ShapeSchedule
    from dflash_sglang.core.shape.goodput import GoodputConfig, GoodputController

    cost = simulated_step_cost({"DFLASH_SIMULATE_STEP_COST": "0.02,0.001,0.0001,0.004,0.0002,0.0005"})
    assert simulated_step_cost({}) is None
    with pytest.raises(ValueError, match=r"^DFLASH_SIMULATE_STEP_COST: .*6 seconds"):
        simulated_step_cost({"DFLASH_SIMULATE_STEP_COST": "0.02,0.001"})
    schedule = ShapeSchedule(8, controller=GoodputController(GoodputConfig(max_nodes=8)), step_cost=cost)
    seen = []
    observe = schedule.controller.observe
    schedule.controller.observe = lambda shape, acc, sec, ranks=None: (seen.append((shape, len(acc), sec)),
                                                                        observe(shape, acc, sec, ranks))
    for i in range(12):
        shape = schedule.choose(3)
        schedule.observe(shape, [min(shape.nodes - 1, 1)] * 3, None if i == 5 else 123.0 * i)
    assert [sec for _, _, sec in seen][5] is None
    assert all(sec == cost.seconds(shape, bs) for i, (shape, bs, sec) in enumerate(seen) if i != 5), seen
