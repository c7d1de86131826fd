"""A hybrid target's recurrent state under our worker (adapter/step/hybrid.py), against fakes of SGLang's pieces.

The fake linear layer keeps a per-request state that every token updates (a non-commutative fold, so order and
membership both matter). The fake verify writes the state after every verify row into per-row scratch, each row from
its tree parent's as SGLang's tree kernels find it from the tree links; the fake backend's commit copies rows into the
live and tracking slots as `update_mamba_state_after_mtp_verify` does. After `HybridTarget.commit` each request's live
state must be the fold over exactly its committed tokens (core/step/recurrent.py's rule), and a tracking slot the fold
up to its tracking point. GPU end-to-end: docs/gpu_session.md.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang_support import requires_sglang

from dflash_sglang.core.step.tree import build_tree
from dflash_sglang.core.step.tree_verify import verify_tree_greedy

pytestmark = requires_sglang

VOCAB = 7


def fold(state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """One token's update of the fake recurrent state (float64: exact for the sizes here)."""
    return state * 1.7 + token.to(torch.float64) + 1.0


def parents_from_links(nxt: torch.Tensor, sib: torch.Tensor) -> torch.Tensor:
    """Each row's parent [bs, N] (-1 for the root), walking first-child / next-sibling links as SGLang's tree
    kernels do."""
    bs, n = nxt.shape
    parent = torch.full((bs, n), -1, dtype=torch.int64)
    for b in range(bs):
        for i in range(n):
            child = int(nxt[b, i])
            while child >= 0:
                parent[b, child] = i
                child = int(sib[b, child])
    return parent


class FakeBackend:
    """SGLang's hybrid backend, reduced to the state it owns: live [slots], tracking [slots], scratch [bs, N]."""

    def __init__(self, live: torch.Tensor, slots: torch.Tensor):
        self.live, self.slots = live, slots
        self.track = torch.full_like(live, float("nan"))
        self.scratch = None

    def verify(self, ids: torch.Tensor, links) -> None:
        """The state after every verify row, each from its parent's (the root from the live state)."""
        parent = parents_from_links(*links)
        bs, n = ids.shape
        self.scratch = torch.empty(bs, n, dtype=torch.float64)
        for i in range(n):
            before = torch.where(parent[:, i] < 0, self.live[self.slots],
                                 self.scratch.gather(1, parent[:, i:i + 1].clamp_min(0))[:, 0])
            self.scratch[:, i] = fold(before, ids[:, i])

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                            mamba_steps_to_track, model, req_pool_indices=None):
        rows = torch.arange(len(last_correct_step_indices))
        self.live[self.slots] = self.scratch[rows, last_correct_step_indices]
        if mamba_track_indices is not None:
            ok = mamba_steps_to_track >= 0
            self.track[mamba_track_indices[ok]] = self.scratch[rows[ok], mamba_steps_to_track[ok]]


def _case(tree: bool, seed: int, interval: int, monkeypatch):
    from dflash_sglang.adapter.step import hybrid
    from dflash_sglang.adapter.step.hybrid import HybridTarget

    monkeypatch.setattr(hybrid, "mamba_track_interval", lambda page_size: interval)
    g = torch.Generator().manual_seed(seed)
    bs, n = 5, 8
    prompts = [torch.randint(0, VOCAB, (int(k),), generator=g) for k in torch.randint(1, 20, (bs,), generator=g)]
    slots = torch.randperm(2 * bs, generator=g)[:bs]
    live = torch.zeros(2 * bs, dtype=torch.float64)
    for slot, p in zip(slots.tolist(), prompts):
        for t in p:
            live[slot] = fold(live[slot], t)
    backend = FakeBackend(live, slots)
    worker = HybridTarget(backend, model=None, server_topk=4 if tree else 1)
    bonus = torch.randint(0, VOCAB, (bs,), generator=g)
    target_next = torch.randint(0, VOCAB, (bs, n), generator=g)  # the target's greedy choice after each row
    if tree:
        logp, tokens = torch.randn(bs, n - 1, VOCAB, generator=g).log_softmax(-1).topk(3, dim=-1)
        t = build_tree(bonus, tokens, logp, n)
        ids, links = t.tokens, worker.links(t, bs, n, "cpu")
        # make some drafts right: the target agrees with the first child wherever one exists
        agree = torch.rand(bs, n, generator=g) < 0.7
        target_next = torch.where(agree & (t.retrive_next_token >= 0),
                                  t.tokens.gather(1, t.retrive_next_token.clamp_min(0)), target_next)
        res = verify_tree_greedy(t, target_next)
        accept_len, path = res.accept_len, res.accept_nodes
        committed = [ids[b, path[b, : int(accept_len[b]) + 1]] for b in range(bs)]
    else:
        ids = torch.cat([bonus[:, None], torch.randint(0, VOCAB, (bs, n - 1), generator=g)], 1)
        agree = torch.rand(bs, n - 1, generator=g) < 0.7
        ids[:, 1:] = torch.where(agree, target_next[:, :-1], ids[:, 1:])
        accept_len = (ids[:, 1:] == target_next[:, :-1]).long().cumprod(1).sum(1)
        links, path = worker.links(None, bs, n, "cpu"), None
        if links is None:  # top-k 1: chain kernels, each row from the previous one
            from dflash_sglang.adapter.step.hybrid import chain_links
            links = chain_links(bs, n, "cpu")
        committed = [ids[b, : int(accept_len[b]) + 1] for b in range(bs)]
    backend.verify(ids, links)
    seq_lens = torch.tensor([len(p) for p in prompts])
    batch = SimpleNamespace(mamba_track_indices=torch.arange(bs) + 100 if interval else None,
                            tree_cache=SimpleNamespace(page_size=1), req_pool_indices=torch.arange(bs))
    if interval:
        backend.track = torch.full((200,), float("nan"), dtype=torch.float64)
    worker.commit(batch, seq_lens, accept_len, path)
    return prompts, committed, backend, interval


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("seed", [1, 2, 3, 6])
@pytest.mark.parametrize("interval", [0, 4])
def test_commit_leaves_each_request_in_its_committed_tokens_state(tree, seed, interval, monkeypatch):
    prompts, committed, backend, interval = _case(tree, seed, interval, monkeypatch)
    assert max(len(c) for c in committed) >= 3 and min(len(c) for c in committed) <= 2  # long and short commits
    for b, (p, c) in enumerate(zip(prompts, committed)):
        tokens = torch.cat([p, c])
        want = torch.zeros((), dtype=torch.float64)
        states = []
        for t in tokens:
            want = fold(want, t)
            states.append(want)
        assert backend.live[backend.slots[b]] == want, (b, tree)
        if interval:  # a tracking point inside this commit: the slot holds the state of the prefix up to it
            pre, post = len(p), len(tokens)
            point = post // interval * interval
            track = backend.track[100 + b]
            if pre // interval != post // interval and point > pre:
                assert track == states[point - 1], (b, pre, post)
            else:
                assert torch.isnan(track), (b, pre, post)


def test_chain_links_and_tracking_steps():
    from dflash_sglang.adapter.step.hybrid import chain_links, track_steps

    nxt, sib = chain_links(2, 4, "cpu")
    assert nxt.tolist() == [[1, 2, 3, -1]] * 2 and (sib == -1).all()
    assert parents_from_links(nxt, sib).tolist() == [[-1, 0, 1, 2]] * 2
    # lengths 6 and 7 commit 3 tokens each with interval 4: 6 -> 9 crosses 8 (the token at 7, commit index 1);
    # 7 -> 10 crosses 8 (the token at 7 is the commit's first, index 0)
    assert track_steps(torch.tensor([6, 7, 1]), torch.tensor([3, 3, 2]), 4, None).tolist() == [1, 0, -1]
    path = torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1], [0, -1, -1, -1]])
    assert track_steps(torch.tensor([6, 7, 1]), torch.tensor([3, 2, 1]), 4, path).tolist() == [2, 0, -1]


def test_scratch_bytes_count_a_shared_window_once():
    from dflash_sglang.adapter.step.hybrid import state_scratch_bytes

    ssm = torch.zeros(2, 3, 4, 5, dtype=torch.float32)
    window = torch.zeros(100, dtype=torch.bfloat16)
    views = [window[:60].view(6, 10), window[40:].view(6, 10)]  # two layers' views of one deduplicated buffer
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=SimpleNamespace(
        intermediate_ssm=ssm, intermediate_conv_window=views)))
    assert state_scratch_bytes(pool) == ssm.numel() * 4 + 100 * 2
    assert state_scratch_bytes(SimpleNamespace()) == 0
