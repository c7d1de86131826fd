"""The drafter's sliding context window (core/draft/drafter.py `context_window`, the definition of
`--speculative-draft-window-size W`): a block at committed length L reads only context positions L-W .. L-1."""
from __future__ import annotations

import pytest
import torch

from factories import draft_config_for, mixed_prompts, tiny_drafter, tiny_target
from sglang_support import requires_sglang

# (the adapter's modules need a supported sglang installed, not importable: this process never imports it)
pytestmark = requires_sglang

BLOCK = 4


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(draft_config_for(tiny_target("llama"), block_size=BLOCK))


@pytest.mark.parametrize("window", [1, 3, 7])
def test_window_reads_the_last_w_context_rows(drafter, window):
    """Mixed committed lengths (left-padded batch): each row's output equals the drafter run on its last W context rows
    alone, and differs from the full-context output where the context is longer than W."""
    lens, H = (9, 2, 5), drafter.cfg.hidden_size
    S = max(lens)
    ctx = torch.randn(len(lens), S, H)
    ctx_pos = torch.stack([torch.arange(S) - (S - n) for n in lens]).clamp_min(0)  # left padding at position 0
    valid = torch.stack([torch.arange(S) >= S - n for n in lens])
    block = torch.randn(len(lens), BLOCK, H)
    pos = torch.tensor(lens)[:, None] + torch.arange(BLOCK)
    full = drafter(block, pos, drafter.context_kv(ctx, ctx_pos), ctx_pos, ctx_valid=valid)
    drafter.context_window = window
    try:
        got = drafter(block, pos, drafter.context_kv(ctx, ctx_pos), ctx_pos, ctx_valid=valid)
    finally:
        drafter.context_window = None
    for i, n in enumerate(lens):
        keep = min(n, window)
        sub_ctx, sub_pos = ctx[i:i + 1, S - keep:], ctx_pos[i:i + 1, S - keep:]
        alone = drafter(block[i:i + 1], pos[i:i + 1], drafter.context_kv(sub_ctx, sub_pos), sub_pos)
        torch.testing.assert_close(got[i:i + 1], alone, rtol=1e-5, atol=1e-5)
        if n > window:
            assert not torch.allclose(got[i], full[i], atol=1e-4)
        else:
            torch.testing.assert_close(got[i], full[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [4, 6])
def test_reference_decoder_with_a_window_is_lossless(window):
    """Greedy speculative decoding with a draft window shorter than the prompts equals plain greedy decoding."""
    from dflash_sglang.core.reference import ReferenceDecoder

    target = tiny_target("llama", vocab=96, seed=3)
    drafter = tiny_drafter(draft_config_for(target, block_size=BLOCK))
    drafter.context_window = window
    prompts = mixed_prompts(96, lengths=(3, 9, 1, 14, 6, 20))
    assert max(len(p) for p in prompts) > window
    dec = ReferenceDecoder(target, drafter)
    spec = dec.generate(prompts, 20, block_size=BLOCK)
    plain = dec.plain_generate(prompts, 20)
    assert [g.tokens for g in spec] == [p.tokens if hasattr(p, "tokens") else p for p in plain]


# ---------------------------------------------------------------------------------------------- the served pool
# adapter/draft/context_rows.py behind adapter/draft/model.py `PagedDrafter`: the worker's draft pass and commits
# (prefill chunks, each decode step's verify rows, rejected ones included) on a ring of R rows per request slot
# (`WindowRows`, the radix cache off) or on the slot rows read over the last W positions (`SlotRows` with a window).
POOL_IDX = (3, 0, 5, 2)  # request-pool slots, not in batch order
REQ_SLOTS, WINDOW, NODES = 6, 5, BLOCK  # R = W + N - 1 = 8
WIDTH = 64  # req_to_token columns (the slot rows' contexts)
# The drafts a window serves: DFlash (full layers), Gemma-4 style (a causal sliding-window layer), DFlash2
# (convolutions, a bidirectional sliding-window layer) and, on the dense path (a window narrower than the block,
# FlashInfer's fallback), a DFlash2 whose window the paged backend cannot express; each with a full layer, which the
# draft window narrows
_DFLASH2_LAYERS = ("sliding_attention", "full_attention")
SHAPES = {"qwen3": {}, "gemma4": {"sliding_window": 3},
          "dflash2": {"sliding_window": BLOCK, "layer_types": _DFLASH2_LAYERS},
          "dflash2_dense": {"sliding_window": 3, "layer_types": _DFLASH2_LAYERS}}


def _window_rows():
    from dflash_sglang.adapter.draft.context_rows import WindowRows, ring_size

    return WindowRows(WINDOW, ring_size(WINDOW, NODES), REQ_SLOTS)


def test_window_layout_reads_ring_rows_of_the_last_w_positions():
    rows = _window_rows()
    assert rows.ring == 8 and rows.rows == REQ_SLOTS * 8
    seq_lens, scratch = torch.tensor([3, 12, 5, 30]), 1000
    layout = rows.layout(torch.empty(0), torch.tensor(POOL_IDX), seq_lens, seq_lens, BLOCK, scratch)
    assert layout.kv_indptr_cpu.tolist() == [0, 7, 16, 25, 34]
    assert layout.qo_indptr_cpu.tolist() == [0, 4, 8, 12, 16]
    kv = layout.kv_indices.tolist()
    for i, (n, r) in enumerate(zip(seq_lens.tolist(), POOL_IDX)):
        seg = kv[layout.kv_indptr_cpu[i]:layout.kv_indptr_cpu[i + 1]]
        ring = [r * 8 + p % 8 for p in range(max(0, n - WINDOW), n)]
        assert seg == ring + [scratch + r * BLOCK + j for j in range(BLOCK)]


def test_slot_rows_layout_reads_the_slots_of_the_last_w_positions():
    """A window over the slot rows: request i's keys are req_to_token[r, L-k .. L-1] (k = min(L, W)), then its block
    scratch; without a window the whole context."""
    from dflash_sglang.adapter.draft.context_rows import SlotRows

    r2t = torch.randperm(1000)[: REQ_SLOTS * WIDTH].view(REQ_SLOTS, WIDTH).to(torch.int32)
    seq_lens, scratch = torch.tensor([3, 12, 5, 30]), 1000
    for window in (WINDOW, None):
        layout = SlotRows(scratch, window).layout(r2t, torch.tensor(POOL_IDX), seq_lens, seq_lens, BLOCK, scratch)
        kv = layout.kv_indices.tolist()
        for i, (n, r) in enumerate(zip(seq_lens.tolist(), POOL_IDX)):
            seg = kv[layout.kv_indptr_cpu[i]:layout.kv_indptr_cpu[i + 1]]
            first = 0 if window is None else max(0, n - window)
            assert seg == r2t[r, first:n].tolist() + [scratch + r * BLOCK + j for j in range(BLOCK)]


def test_prefill_writes_only_the_last_r_positions_of_a_long_chunk():
    """A chunk longer than R writes its last R positions only (no repeated scatter index); shorter ones all."""
    rows = _window_rows()
    extend = [3, 13, 8]  # (13 > R = 8)
    prefix = [0, 4, 20]
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
    index, got = rows.prefill(positions, torch.full_like(positions, -1), torch.tensor(POOL_IDX[:3]), extend)
    keep = list(range(3)) + list(range(3 + 5, 3 + 13)) + list(range(16, 24))
    assert index.tolist() == keep
    owners = [POOL_IDX[0]] * 3 + [POOL_IDX[1]] * 8 + [POOL_IDX[2]] * 8
    assert got.tolist() == [r * 8 + int(positions[k]) % 8 for r, k in zip(owners, keep)]
    assert len(set(got.tolist())) == len(keep)
    index, _ = rows.prefill(positions[:3], positions[:3], torch.tensor(POOL_IDX[:1]), [3])
    assert index is None  # every token written: no gather


def test_window_pool_is_bounded_by_request_slots():
    """The pool holds req_slots x R context rows (+ the block scratch) whatever the target's KV capacity."""
    from dflash_sglang.adapter.draft.model import PagedDrafter
    from dflash_sglang.adapter.draft.pool import pool_rows

    core = tiny_drafter(draft_config_for(tiny_target("qwen3"), block_size=BLOCK))
    sizes = {PagedDrafter.load("unused", slots, REQ_SLOTS, BLOCK, torch.float32, "cpu", weights=core,
                               context_rows=_window_rows()).pool.rows for slots in (64, 4096, 1 << 16)}
    assert sizes == {pool_rows(REQ_SLOTS * 8, REQ_SLOTS, BLOCK)}


def _paged(shape: str, layout: str, monkeypatch):
    """(core drafter, PagedDrafter over the layout's rows, req_to_token [REQ_SLOTS, WIDTH] int32 of distinct slots)."""
    from factories import DFLASH2_DRAFT, GEMMA4_DRAFT

    from dflash_sglang.adapter.draft.attention import FlashInferPagedAttention, TorchPagedAttention
    from dflash_sglang.adapter.draft.context_rows import SlotRows
    from dflash_sglang.adapter.draft.model import PagedDrafter

    torch.manual_seed(0)
    base = {"qwen3": {}, "gemma4": GEMMA4_DRAFT}.get(shape, DFLASH2_DRAFT)
    cfg = draft_config_for(tiny_target("qwen3"), block_size=BLOCK, **{**base, **SHAPES[shape]})
    if shape == "dflash2_dense":  # the torch backend made to answer as FlashInfer does: the dense path
        monkeypatch.setattr(TorchPagedAttention, "expresses", staticmethod(FlashInferPagedAttention.expresses))
    core = tiny_drafter(cfg)
    slots = 1 + REQ_SLOTS * WIDTH  # slot 0: SGLang's padding slot
    r2t = (1 + torch.randperm(slots - 1)).view(REQ_SLOTS, WIDTH).to(torch.int32)
    rows = _window_rows() if layout == "ring" else SlotRows(slots, WINDOW)
    paged = PagedDrafter.load("unused", slots, REQ_SLOTS, BLOCK, torch.float32, "cpu", weights=core, context_rows=rows)
    assert (paged.attention is None) == (shape == "dflash2_dense")
    return core, paged, r2t


@pytest.mark.parametrize("layout, shape", [("ring", s) for s in SHAPES if s != "dflash2_dense"]
                         + [("slots", s) for s in SHAPES])
def test_paged_window_pass_and_commits_equal_the_reference_drafter(layout, shape, monkeypatch):
    """Mixed-length batch; chunked prefill (a chunk longer than R; two requests per extend batch); decode steps whose
    verify rows are all committed (ring rows or their own KV slots), rejected ones with features that are not the
    context's (the next step rewrites them); contexts grow past W and R. Every pass equals the core drafter with
    `context_window` W over the true context (and differs from the full-context pass once a context is longer than W).
    The ring (the radix cache off) and the slot rows read over the last W (the radix cache on), each over DFlash,
    Gemma-4 style (causal sliding-window layers) and DFlash2 drafts on the paged path; the slot rows also on the dense
    path (a bidirectional window narrower than the block, which FlashInfer cannot express)."""
    core, paged, r2t = _paged(shape, layout, monkeypatch)
    cfg, rows = core.cfg, paged.context_rows
    H, F = cfg.hidden_size, cfg.n_features * cfg.hidden_size
    rpi = torch.tensor(POOL_IDX)
    prompts = (3, 13, 21, 6)
    truth = [torch.randn(n, F) for n in prompts]  # each request's committed features, position by position

    def slots_of(i: int, positions):  # the target KV slots SGLang gave request i's positions
        return r2t[POOL_IDX[i], positions].to(torch.int64)

    def extend(pieces):  # [(request, start, end)]: one extend batch
        positions = torch.cat([torch.arange(s, e) for _, s, e in pieces])
        loc = torch.cat([slots_of(i, torch.arange(s, e)) for i, s, e in pieces])
        hidden = torch.cat([truth[i][s:e] for i, s, e in pieces])
        paged.commit_extend(hidden, positions, loc, rpi[[i for i, _, _ in pieces]], [e - s for _, s, e in pieces])

    extend([(0, 0, 3), (1, 0, 13), (2, 0, 12)])
    extend([(2, 12, 21), (3, 0, 6)])

    def reference(i: int, embeds, pos, window):
        n = pos[0, 0].item()
        ctx_pos = torch.arange(n)[None]
        core.context_window = window
        try:
            return core(embeds, pos, core.context_kv(core.fuse(truth[i][:n])[None], ctx_pos), ctx_pos)[0]
        finally:
            core.context_window = None

    g = torch.Generator().manual_seed(1)
    differs = 0
    for step in range(10):
        lens = torch.tensor([t.shape[0] for t in truth])
        b = BLOCK if step % 3 else 2  # a short chain drafts with a block of its own length
        embeds = torch.randn(len(prompts), b, H)
        pos = lens[:, None] + torch.arange(b)
        got = paged.draft(embeds, pos, r2t, rpi, lens)
        for i in range(len(prompts)):
            want = reference(i, embeds[i:i + 1], pos[i:i + 1], WINDOW)
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
            if lens[i] > WINDOW:
                differs += not torch.allclose(got[i], reference(i, embeds[i:i + 1], pos[i:i + 1], None), atol=1e-4)
        # the verify: n rows at L .. L+n-1, accepted a + 1 of them; every row's K/V written (rejected: other features)
        n = NODES if step % 2 else 3
        verify_pos = lens[:, None] + torch.arange(n)
        accepted = torch.randint(0, n, (len(prompts),), generator=g)
        hidden = torch.randn(len(prompts), n, F)
        for i in range(len(prompts)):
            truth[i] = torch.cat([truth[i], hidden[i, :accepted[i] + 1]])
        verify_slots = torch.stack([slots_of(i, verify_pos[i]) for i in range(len(prompts))])
        paged.commit(hidden.reshape(-1, F), verify_pos.reshape(-1), rows.decode(verify_pos, verify_slots, rpi))
    assert min(t.shape[0] for t in truth) > 8  # every ring wrapped around (R = 8)
    assert differs > 0
