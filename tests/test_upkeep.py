"""adapter/step/upkeep.py: plain steps' draft K/V written later, in one commit, equal to one commit per step."""
from __future__ import annotations

import pytest
import torch
from factories import draft_config_for, tiny_drafter, tiny_target
from sglang_support import requires_sglang

from dflash_sglang.adapter.step.upkeep import MAX_STEPS, PlainUpkeep, upkeep_steps

BLOCK, REQ_SLOTS, SLOTS = 4, 6, 96


def _drafter():
    from dflash_sglang.adapter.draft.model import PagedDrafter

    core = tiny_drafter(draft_config_for(tiny_target("qwen3"), block_size=BLOCK), seed=3)
    return PagedDrafter.load("unused", SLOTS, REQ_SLOTS, BLOCK, torch.float32, "cpu", weights=core)


@requires_sglang
def test_deferred_plain_steps_write_what_a_commit_per_step_writes():
    """Three requests, five plain steps (one features row each per step, slots not in order), then a drafted step's
    catch-up: the pool's context rows equal those of a commit at every step, and nothing else is written."""
    torch.manual_seed(0)
    eager, deferred = _drafter(), _drafter()
    upkeep = PlainUpkeep(enabled=True)
    n_feat = eager.drafter.fc.in_features
    slots = torch.randperm(SLOTS)[:15].view(5, 3)  # step s, request i
    positions = torch.tensor([7, 2, 11])
    key = ("a", "b", "c")
    for s in range(5):
        features = torch.randn(3, n_feat)
        eager.commit(features, positions + s, slots[s])
        assert not upkeep.due(key, drafted=False)
        assert not upkeep.defer(key, features, positions + s, slots[s])
    assert upkeep.steps == 5 and upkeep.due(key, drafted=True) and upkeep.due(("a", "b"), drafted=False)
    deferred.commit(*upkeep.take())
    assert upkeep.take() is None and upkeep.steps == 0
    torch.testing.assert_close(deferred.pool.k, eager.pool.k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(deferred.pool.v, eager.pool.v, rtol=1e-5, atol=1e-6)
    assert eager.pool.k[:, slots.reshape(-1)].abs().sum() > 0  # (the rows were written at all)


@requires_sglang
def test_a_rings_deferred_steps_write_what_a_commit_per_step_writes():
    """A draft window's ring (R rows per request, position p at row r*R + p % R): plain steps deferred at most R at a
    time (`upkeep_steps`), three requests over 2R + 3 steps that wrap their rings, each cap's catch-up and the last
    one's, leave the pool as a commit at every step does; past R pending, one request's rows would repeat."""
    from dflash_sglang.adapter.draft.context_rows import WindowRows

    torch.manual_seed(1)
    ring = WindowRows(window=4, ring=5, req_slots=REQ_SLOTS)
    assert upkeep_steps(None) == MAX_STEPS == upkeep_steps(10 * MAX_STEPS) and upkeep_steps(ring.ring) == 5
    eager, deferred = _drafter(), _drafter()
    upkeep = PlainUpkeep(enabled=True, max_steps=upkeep_steps(ring.ring))
    n_feat = eager.drafter.fc.in_features
    req_pool, positions, key = torch.tensor([4, 0, 2]), torch.tensor([7, 2, 11]), ("a", "b", "c")
    catch_ups = 0
    for s in range(2 * ring.ring + 3):
        features, rows = torch.randn(3, n_feat), ring.ring_rows(req_pool, positions + s)
        eager.commit(features, positions + s, rows)
        if upkeep.defer(key, features, positions + s, rows):
            pending = upkeep.take()
            assert pending[2].unique().numel() == pending[2].numel()  # (no row twice in one scatter)
            deferred.commit(*pending)
            catch_ups += 1
    deferred.commit(*upkeep.take())
    assert catch_ups == 2
    torch.testing.assert_close(deferred.pool.k, eager.pool.k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(deferred.pool.v, eager.pool.v, rtol=1e-5, atol=1e-6)
    wrapped = ring.ring_rows(req_pool[:1], positions[:1] + torch.arange(ring.ring + 1))
    assert wrapped.unique().numel() == ring.ring  # R + 1 steps of one request: a row written twice


def test_caps_ask_for_a_commit_and_another_batch_must_be_written_first():
    upkeep = PlainUpkeep(enabled=True, max_steps=3, max_bytes=10 * 4 * 8)
    row = torch.arange(2)
    assert not upkeep.defer("k", torch.zeros(2, 8), row, row)
    assert not upkeep.defer("k", torch.zeros(2, 8), row, row)
    assert upkeep.defer("k", torch.zeros(2, 8), row, row)  # the step cap
    features, positions, rows = upkeep.take()
    assert features.shape == (6, 8) and positions.shape == rows.shape == (6,)
    assert upkeep.defer("k", torch.zeros(6, 8), row.repeat(3), row.repeat(3)) is False
    assert upkeep.defer("k", torch.zeros(6, 8), row.repeat(3), row.repeat(3))  # the byte cap (2 x 6 x 8 floats)
    upkeep.take()
    upkeep.defer("k", torch.zeros(2, 8), row, row)
    with pytest.raises(AssertionError, match="another batch"):
        upkeep.defer("other", torch.zeros(2, 8), row, row)


def test_a_replayed_graphs_features_are_copied():
    upkeep = PlainUpkeep(enabled=True)
    buffer, row = torch.ones(2, 4), torch.arange(2)
    upkeep.defer("k", buffer, row, row, copy=True)
    buffer.zero_()  # the next replay overwrites the graph's output buffer
    assert upkeep.take()[0].sum() == 8
