"""DP attention's step plan (adapter/scale/dp_attention.py): every rank derives the same verify shape and row counts.

The CPU Engines under DP attention (tests/test_sglang_e2e.py `attn_dp2_*`) check the whole path against plain."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang_support import requires_sglang

from dflash_sglang.adapter.scale.dp_attention import DECODE, EXTEND, IDLE, AttentionDP, StepPlan
from dflash_sglang.core.shape.adaptive import SpecShape

# (the adapter's modules need a supported sglang installed, not importable: this process never imports it)
pytestmark = requires_sglang


def test_decoding_groups_verify_their_smallest_shape_ties_to_the_lowest_group():
    plan = StepPlan.agree([DECODE, EXTEND, DECODE, DECODE], [(6, 1), (0, 0), (4, 2), (4, 1)])
    assert plan.shape == SpecShape(4, 2)  # 4 nodes is the smallest; group 2 comes before group 3
    assert not plan.uniform and plan.any_work
    # an extend group's (0, 0) never wins: only decoding groups are read
    assert StepPlan.agree([EXTEND, DECODE], [(0, 0), (8, 1)]).shape == SpecShape(8, 1)
    assert StepPlan.agree([IDLE, EXTEND], [(0, 0), (0, 0)]).shape is None
    assert not StepPlan.agree([IDLE, IDLE], [(0, 0), (0, 0)]).any_work
    assert StepPlan.agree([DECODE, DECODE], [(3, 1), (5, 2)]).uniform


def test_counts_scale_only_decoding_groups_by_the_agreed_width():
    plan = StepPlan.agree([DECODE, EXTEND, IDLE, DECODE], [(5, 1), (0, 0), (0, 0), (7, 1)])
    # raw counts as SGLang's scheduler gathers them: requests (decode), extend tokens (prefill), 0 (idle)
    assert plan.counts([3, 40, 0, 2]) == [15, 40, 0, 10]
    with pytest.raises(AssertionError):
        plan.counts([3, 40])


class _Group:
    """A TP group whose CPU all-gather returns every rank's row (the other ranks' rows given)."""

    def __init__(self, rows: list[list[int]], rank: int) -> None:
        self.rows, self.rank, self.world_size, self.cpu_group = rows, rank, len(rows), object()
        self.rank_in_group = rank  # (SGLang's GroupCoordinator's name)


@pytest.fixture(autouse=True)
def gather(monkeypatch):
    """torch.distributed.all_gather over a _Group's cpu_group: host int64 rows only."""
    groups: dict[int, _Group] = {}

    def all_gather(out, t, group=None):
        g = groups[id(group)]
        assert t.device.type == "cpu" and t.dtype == torch.int64 and t.shape == (3,) and len(out) == g.world_size
        for i, (o, r) in enumerate(zip(out, g.rows)):
            o.copy_(t if i == g.rank else torch.tensor(r))

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    return groups


def _dp(groups: int, attn_tp: int, rows: list[list[int]], rank: int, registry) -> AttentionDP:
    group = _Group(rows, rank)
    registry[id(group.cpu_group)] = group
    return AttentionDP(groups, attn_tp, group)


@pytest.mark.parametrize("rank", range(4))
def test_every_rank_of_every_group_derives_the_same_plan(gather, rank):
    # 2 groups x 2 attention-TP ranks, group-major: ranks 0, 1 share group 0's batch (decode, a tree of 6), ranks 2, 3
    # group 1's (decode, a chain of 4, capped at its context limit)
    rows = [[DECODE, 6, 2], [DECODE, 6, 2], [DECODE, 4, 1], [DECODE, 4, 1]]
    mine = rows[rank]
    dp = _dp(2, 2, rows, rank, gather)
    plan = dp.plan(mine[0], SpecShape(mine[1], mine[2]))
    assert plan == StepPlan((DECODE, DECODE), SpecShape(4, 1))
    # the group whose random stream the rank draws (worker: --random-seed offset by it): shared within a group only
    assert dp.index == rank // 2


def test_an_idle_rank_takes_part_and_apply_writes_coordinated_counts(gather):
    rows = [[IDLE, 0, 0], [DECODE, 5, 1]]
    dp = _dp(2, 1, rows, 0, gather)
    plan = dp.plan(IDLE, None)
    assert plan.shape == SpecShape(5, 1) and plan.any_work and not plan.uniform
    batch = SimpleNamespace(global_num_tokens=[0, 3], global_num_tokens_for_logprob=[0, 3],
                            dp_spec_prefill_coordination_applied=False)
    dp.apply(batch, plan)
    assert batch.global_num_tokens == [0, 15] and batch.global_num_tokens_for_logprob == [0, 15]
    assert batch.dp_spec_prefill_coordination_applied  # SGLang neither rescales nor pads to one forward mode
    lone = SimpleNamespace(global_num_tokens=None, dp_spec_prefill_coordination_applied=False)
    dp.apply(lone, plan)  # no gather ran: nothing to write
    assert lone.global_num_tokens is None and not lone.dp_spec_prefill_coordination_applied
