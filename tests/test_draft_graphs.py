"""The draft pass and commit as static-buffer graphs (adapter/draft/graphs.py): padded replays equal the eager path
on mixed batches (CPU, static mode), DFlash v1 and DFlash2 over full, causal and sliding-window layers (DFlash2: its
selector's candidates and walk replayed with the pass, adapter/draft/selector_graph.py: chains greedy and sampled,
trees, one process or the TP layout), the captured bodies and a DFlash2 step's whole draft side do no host sync (meta
tensors), mode selection; on a GPU, captured CUDA graphs against the eager path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from factories import DFLASH2_DRAFT, GEMMA4_DRAFT, draft_config_for, tiny_drafter, tiny_target
from sglang_support import requires_flashinfer_gpu, requires_sglang

pytestmark = requires_sglang

BLOCK, REQ_SLOTS, WIDTH = 4, 6, 32
SIZES = (2, 4, 8)
# (seq_lens, request-pool slots) per step, replayed in this order: padded 3 -> 4, then 1 -> 2 over the stale
# statics of the larger batch, an exact fit, a batch no captured size holds (eager)
STEPS = [((5, 1, 12), (3, 0, 5)), ((7,), (2,)), ((9, 3, 1, 20), (1, 4, 0, 2)), ((2,) * 9, (0,) * 9)]


# The drafts the graphs replay: DFlash (full layers), a Gemma-4 style DFlash (causal sliding-window layers and a full
# one), DFlash2 as published (convolutions, selector, scaled soft-capped logits over bidirectional sliding-window
# layers) and over full layers. Windows of 5 (>= BLOCK: FlashInfer expresses them), shorter than most STEPS contexts.
DRAFTS = {
    "dflash": {},
    "gemma4": {**GEMMA4_DRAFT, "sliding_window": 5},
    "dflash2": {**DFLASH2_DRAFT, "sliding_window": 5},
    "dflash2_full": {k: v for k, v in DFLASH2_DRAFT.items() if k not in ("layer_types", "sliding_window")},
}


WINDOW = 6  # the draft window of the windowed layouts (most STEPS contexts outrun it)


def _context_rows(layout: str | None, slots: int):
    """The drafter's context rows: None, the whole context over the slot rows; "slots", a draft window over them;
    "ring", a draft window's ring per request slot (R = W + 3 - 1: commits of up to 3 rows per request)."""
    from dflash_sglang.adapter.draft.context_rows import SlotRows, WindowRows, ring_size

    if layout == "ring":
        return WindowRows(WINDOW, ring_size(WINDOW, 3), REQ_SLOTS)
    return SlotRows(slots, WINDOW if layout == "slots" else None)


def _setup(device="cpu", dtype=torch.float32, hidden=32, attention="torch", draft="dflash", layout=None):
    """A PagedDrafter over a pool with committed contexts for every request slot (prefilled where `layout` keeps
    them: `_context_rows`), its TargetHead, req_to_token."""
    from dflash_sglang.adapter.draft.pool import DraftKVPool
    from dflash_sglang.adapter.draft.model import PagedDrafter, TargetHead

    cfg = draft_config_for(tiny_target("qwen3", hidden=hidden), block_size=BLOCK, **DRAFTS[draft])
    torch.manual_seed(0)
    core = tiny_drafter(cfg).to(device, dtype).requires_grad_(False)  # served weights (SGLang runs without autograd)
    slots = 1 + REQ_SLOTS * WIDTH  # slot 0: SGLang's padding slot, never a request's
    req_to_token = (1 + torch.randperm(slots - 1)).view(REQ_SLOTS, WIDTH).to(torch.int32).to(device)
    rows = _context_rows(layout, slots)
    pool = DraftKVPool(cfg.num_hidden_layers, rows.rows + (REQ_SLOTS + 1) * BLOCK, cfg.num_key_value_heads,
                       cfg.head_dim, dtype, device)
    paged = PagedDrafter(core, pool, scratch_base=rows.rows, block=BLOCK, pad_slot=REQ_SLOTS, attention=attention,
                         context_rows=rows)
    for r in range(REQ_SLOTS):
        feats = torch.randn(WIDTH, cfg.n_features * cfg.hidden_size, device=device, dtype=dtype)
        paged.commit_extend(feats, torch.arange(WIDTH, device=device), req_to_token[r].to(torch.int64),
                            torch.tensor([r], device=device), [WIDTH])
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(device, dtype)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    head = TargetHead(embed, lm_head, cfg.mask_token_id, embed_scale=1.5)
    return cfg, paged, head, req_to_token


def _graphs(paged, head, req_to_token, cfg, nodes=(3,), capture=False, top_logits=None, in_graph=True):
    from dflash_sglang.adapter.draft.graphs import DraftGraphs

    selector = paged.drafter.candidate_selector
    return DraftGraphs(paged, head, req_to_token, SIZES, nodes, cfg.n_features * cfg.hidden_size,
                       paged.pool.k.dtype, capture=capture, selector=selector, top_logits=top_logits,
                       select_in_graph=in_graph)


def _step_inputs(seq_lens, pool_idx, cfg, device="cpu"):
    g = torch.Generator().manual_seed(sum(seq_lens))
    bs = len(seq_lens)
    bonus = torch.randint(0, cfg.vocab_size, (bs,), generator=g)
    return bonus.to(device), torch.tensor(seq_lens, device=device), torch.tensor(seq_lens), torch.tensor(pool_idx,
                                                                                                          device=device)


@pytest.mark.parametrize("layout", [None, "slots", "ring"])
@pytest.mark.parametrize("draft", ["dflash", "gemma4"])
def test_static_draft_replays_equal_eager_on_mixed_batches(draft, layout):
    """... over the whole context, and a draft window over the slot rows or its ring (the key rows of the window's
    last positions built on the device by the same kernel, `draft_layout`, from the static seq_lens)."""
    from dflash_sglang.adapter.draft.model import EagerDraftPass

    cfg, paged, head, r2t = _setup(draft=draft, layout=layout)
    assert paged.attention is not None  # (causal and sliding-window layers on the paged path)
    graphs = _graphs(paged, head, r2t, cfg)
    eager = EagerDraftPass(paged, head, r2t)  # the same call as the graphs'
    assert graphs.sizes == list(SIZES) and not graphs.captured
    for seq_lens, pool_idx in STEPS:
        bonus, sl, sl_cpu, idx = _step_inputs(seq_lens, pool_idx, cfg)
        got = graphs(bonus, sl, sl_cpu, idx)
        if len(seq_lens) > max(SIZES):
            assert got is None  # larger than every captured size: the caller runs the pass eagerly
            continue
        want = eager(bonus, sl, sl_cpu, idx)
        assert got.shape == want.shape == (len(seq_lens), BLOCK - 1, cfg.vocab_size)
        assert torch.equal(got, want)  # bit-identical: padding changes no request's numbers
        # the padded requests drafted in the padding slot's scratch, not in a slot a larger batch left behind
        assert graphs.drafts[graphs._size_for(len(seq_lens))].req_pool_indices[len(seq_lens):].eq(REQ_SLOTS).all()


@pytest.mark.parametrize("layout", [None, "ring"])
def test_static_commit_replays_equal_eager(layout):
    """Padded commit rows write the padding scratch's first row, never a context row (a ring's row 0 is request slot
    0's, unlike SGLang's padding KV slot 0)."""
    cfg, paged, head, r2t = _setup(layout=layout)
    _, eager, _, _ = _setup(layout=layout)
    graphs = _graphs(paged, head, r2t, cfg, nodes=(3,))
    pad_row = graphs.pad_row
    assert pad_row == paged.scratch_base + REQ_SLOTS * BLOCK
    feats = cfg.n_features * cfg.hidden_size
    for bs in (3, 1, 8):  # padded, padded over stale rows, exact
        rows = torch.arange(bs * 3)
        hidden = torch.randn(bs * 3, feats)
        # context rows 1.. (the slot rows: past SGLang's padding slot 0; a ring: row 0 stays as request slot 0's)
        positions, slots = WIDTH + rows, (1 + rows * 5) % (paged.context_rows.rows - 1)
        assert graphs.commit(hidden, positions, slots + 1, bs=bs, nodes=3)
        eager.commit(hidden, positions, slots + 1)
        # padded rows (over the stale rows of a larger batch) wrote the padding row
        assert graphs.commits[(graphs._size_for(bs), 3)].slots[bs * 3:].eq(pad_row).all()
    assert not graphs.commit(hidden[:3], positions[:3], slots[:3], bs=3, nodes=1)  # no graph for 1 row / request
    real = torch.ones(paged.pool.rows, dtype=torch.bool)
    real[pad_row] = False  # padded rows wrote the padding scratch, which no pass reads as context
    for pool_a, pool_b in ((paged.pool.k, eager.pool.k), (paged.pool.v, eager.pool.v)):
        torch.testing.assert_close(pool_a[:, real], pool_b[:, real], rtol=1e-6, atol=1e-6)


def _top(vocab: int, shards: int):
    """A DFlash2 selector's candidates over the whole vocabulary (adapter/scale/tp.py DraftVocab.top_logits): one
    process's, or merged from `shards` vocab shards as the TP ranks merge them (the all-gather done in process)."""
    from dflash_sglang.core.step.vocab_parallel import VocabShard, local_top, merge_top

    per = -(-vocab // shards)

    def top_logits(logits, k):
        parts = [local_top(logits[..., r * per: (r + 1) * per], VocabShard(r * per, min(per, vocab - r * per)), k)
                 for r in range(shards)]
        return merge_top(torch.stack([t for t, _ in parts]), torch.stack([v for _, v in parts]), k)

    return top_logits


def _same_scores(got, want, bonus, exact=True):
    """Two DFlash2 SelectorScores agree bit for bit on everything a step asks of them: candidates, the chain's walk
    and its q, a tree's proposal, the walk's ranks. exact=False (a GPU's matmul may round a batch of another size
    differently): the float scores within float32 rounding, every token and tree link still equal."""
    from dflash_sglang.core.shape.adaptive import SpecShape
    from dflash_sglang.core.speculate import propose

    def same(a, b, what):
        if exact or not a.is_floating_point():
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)

    for field in ("tokens", "unary", "hidden", "successors"):
        same(getattr(got.candidates, field), getattr(want.candidates, field), field)
    depth = BLOCK - 1
    assert torch.equal(got.walk(depth), want.walk(depth))
    got_q, want_q = got.chain_q(depth), want.chain_q(depth)
    assert (got_q is None) == (want_q is None)
    if got_q is not None:
        assert torch.equal(got_q.tokens, want_q.tokens)
        same(got_q.probs, want_q.probs, "q")
    for shape in (SpecShape(3, 1), SpecShape(BLOCK, 1), SpecShape(7, 2), SpecShape(10, 3)):
        a, b = propose(bonus, got, shape), propose(bonus, want, shape)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.depth, b.depth), shape
        if shape.is_chain:
            assert (a.q is None) == (b.q is None)
            if a.q is not None:
                same(a.q.probs, b.q.probs, "chain q")
        else:
            for field in ("parent", "score", "mask", "retrive_next_token", "retrive_next_sibling"):
                same(getattr(a.tree, field), getattr(b.tree, field), field)
    assert torch.equal(got.ranks(got.walk(depth)), want.ranks(want.walk(depth)))


@pytest.mark.parametrize("draft", ["dflash2", "dflash2_full", "dflash2_full_slots", "dflash2_full_ring"])
@pytest.mark.parametrize("layout", ["one_process", "tp_layout"])
@pytest.mark.parametrize("sampling", ["greedy", "mixed"])
def test_static_dflash2_selection_equals_eager(layout, sampling, draft):
    """A DFlash2 draft's pass and selection replayed (static mode: the shared buffers and padding of the CUDA graphs)
    equal the eager pass + SelectorScores.of bit for bit over mixed batch sizes (padded, over a larger batch's stale
    rows, temperatures and uniforms, exact, too large for any graph): one process (candidates and walk inside the
    graph) and the TP layout (candidates merged over vocab shards and walked after the replay). Mixed: requests greedy
    and sampled at two temperatures, every other step all greedy; the walk's generator is left where eager leaves it
    (every TP rank draws alike). `_slots` / `_ring`: a draft window over the slot rows / its ring."""
    from dflash_sglang.adapter.draft.model import EagerDraftPass
    from dflash_sglang.core.draft.selector import SelectorScores

    layout = next((w for w in ("slots", "ring") if draft.endswith(f"_{w}")), None)
    cfg, paged, head, r2t = _setup(draft=draft.removesuffix(f"_{layout}"), layout=layout)
    in_graph = layout == "one_process"
    top_logits = _top(cfg.vocab_size, 1 if in_graph else 2)
    graphs = _graphs(paged, head, r2t, cfg, top_logits=top_logits, in_graph=in_graph)
    eager = EagerDraftPass(paged, head, r2t)
    selector = paged.drafter.candidate_selector
    assert graphs.selection.in_graph == in_graph and "selector" in graphs.describe()
    gen_graph, gen_eager = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    sampled_steps = 0
    for step, (seq_lens, pool_idx) in enumerate(STEPS):
        bonus, sl, sl_cpu, idx = _step_inputs(seq_lens, pool_idx, cfg)
        bs = len(seq_lens)
        temperature = None  # every request greedy (the worker knows it from SGLang's is_all_greedy)
        if sampling == "mixed" and step % 2 == 0:
            temperature = torch.tensor([(0.7, 0.0, 1.3)[i % 3] for i in range(bs)])
        any_sampled = temperature is not None  # (row 0 samples: what HostHints tell the worker)
        got = graphs.select(bonus, sl, sl_cpu, idx, temperature, any_sampled, gen_graph)
        if bs > max(SIZES):
            assert got is None  # the caller runs the pass and the selection eagerly
            continue
        hidden, logits = eager.with_hidden(bonus, sl, sl_cpu, idx)
        want = SelectorScores.of(selector, hidden, logits, bonus, temperature, gen_eager, top_logits=top_logits,
                                 any_sampled=any_sampled)
        _same_scores(got, want, bonus)
        sampled_steps += any_sampled and bool((got.chain_q(BLOCK - 1).probs[0] < 1).any())  # a real draw happened
        assert torch.equal(gen_graph.get_state(), gen_eager.get_state())
    assert sampled_steps == (2 if sampling == "mixed" else 0)


def test_graphs_of_a_dflash2_draft_refuse_the_v1_call():
    cfg, paged, head, r2t = _setup(draft="dflash2")
    graphs = _graphs(paged, head, r2t, cfg, top_logits=_top(cfg.vocab_size, 1))
    bonus, sl, sl_cpu, idx = _step_inputs((5, 1), (3, 0), cfg)
    with pytest.raises(AssertionError, match="replays through select"):
        graphs(bonus, sl, sl_cpu, idx)


class _MetaAttention:
    """A paged backend on the meta device: shapes only."""

    name = "meta"

    def for_graph(self, batch_size, kv_indptr_buf, kv_indices_buf):
        return self

    def plan(self, layout):
        pass

    def run(self, q, k_rows, v_rows, kind=None):
        return torch.empty_like(q)


def _meta_graphs(dflash2: bool = False, in_graph: bool = True, layout: str | None = None):
    """DraftGraphs (static mode) over a drafter, pool and head on the meta device (shapes, no data), with the config;
    layout: the context rows (`_context_rows`)."""
    from dflash_sglang.adapter.draft.graphs import DraftGraphs
    from dflash_sglang.adapter.draft.pool import DraftKVPool
    from dflash_sglang.adapter.draft.model import PagedDrafter, TargetHead, random_drafter

    cfg = draft_config_for(tiny_target("qwen3"), block_size=BLOCK, **DRAFTS["dflash2" if dflash2 else "dflash"])
    rows = _context_rows(layout, 64)
    pool = DraftKVPool(cfg.num_hidden_layers, rows.rows + (REQ_SLOTS + 1) * BLOCK, cfg.num_key_value_heads,
                       cfg.head_dim, torch.float32, "meta")
    paged = PagedDrafter(random_drafter(cfg, "meta", torch.float32).requires_grad_(False), pool, rows.rows, BLOCK,
                         pad_slot=REQ_SLOTS, context_rows=rows)
    paged.attention = _MetaAttention()
    head = TargetHead(torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta"),
                      torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta"), cfg.mask_token_id)
    r2t = torch.empty(REQ_SLOTS, WIDTH, dtype=torch.int32, device="meta")
    selector = paged.drafter.candidate_selector
    graphs = DraftGraphs(paged, head, r2t, SIZES, (3, 1), cfg.n_features * cfg.hidden_size, torch.float32, False,
                         selector=selector, top_logits=_top(cfg.vocab_size, 1) if selector is not None else None,
                         select_in_graph=in_graph)
    return graphs, cfg


@pytest.mark.parametrize("draft", ["dflash", "dflash2", "dflash_slots", "dflash_ring"])
def test_captured_bodies_do_no_host_sync(draft):
    """The bodies a CUDA graph captures, run on meta tensors (no data): any host read (.item(), .tolist(), a
    data-dependent shape such as a boolean mask's) raises there, as it would break a capture. DFlash2: the pass, the
    selector's candidates and the chain's walk (greedy and sampled rows alike); a draft window over the slot rows or
    its ring: the key rows from seq_lens."""
    layout = next((w for w in ("slots", "ring") if draft.endswith(f"_{w}")), None)
    graphs, cfg = _meta_graphs(dflash2=draft == "dflash2", layout=layout)
    for size in SIZES:
        graphs._draft_body(graphs.drafts[size])
        assert graphs.drafts[size].logits.shape == (size, BLOCK - 1, cfg.vocab_size)
        if graphs.selection is not None:
            k = DFLASH2_DRAFT["dflash2"].selector_top_k
            assert graphs.drafts[size].selection.walk_q.shape == (size, BLOCK - 1, k)
        for nodes in (3, 1):
            graphs._commit_body(graphs.commits[(size, nodes)])
    with pytest.raises((RuntimeError, NotImplementedError)):  # the check has teeth: a host read fails on meta
        int(graphs.drafts[2].seq_lens.sum())


@pytest.mark.parametrize("layout", ["one_process", "tp_layout"])
def test_dflash2_draft_side_of_a_step_does_no_host_sync(layout):
    """A DFlash2 step's whole draft side on meta tensors, as the worker runs it (adapter/step/worker.py `_scores`, then
    core's propose): the replay's inputs loaded, the walk's uniforms drawn, the pass and selection replayed, then a
    sampled chain with its q and a selector tree grown from the replay's candidates, and the walk's ranks. Only the
    host's own seq_lens mirror is read (to plan the attention). Which requests sample comes from the host hints
    (`some_row_samples`); without them SelectorScores.of reads the temperatures, which fails on meta."""
    from dflash_sglang.core.draft.selector import SelectorScores, some_row_samples
    from dflash_sglang.core.shape.adaptive import SpecShape
    from dflash_sglang.core.speculate import propose
    from dflash_sglang.core.step.accept import HostHints, SamplingParams

    graphs, cfg = _meta_graphs(dflash2=True, in_graph=layout == "one_process")
    bs, meta = 3, {"device": "meta"}
    hints = HostHints(torch.empty(2, dtype=torch.int64, **meta), top_p=False, top_k=0)  # rows 0 and 2 sample
    params = SamplingParams(torch.empty(bs, **meta), torch.empty(bs, dtype=torch.int64, **meta),
                            torch.empty(bs, **meta), hints=hints)
    any_sampled = some_row_samples(params)
    assert any_sampled is True and some_row_samples(None) is False
    bonus = torch.empty(bs, dtype=torch.int64, **meta)
    seq_lens, seq_lens_cpu = torch.empty(bs, dtype=torch.int64, **meta), torch.tensor([5, 1, 12])
    scores = graphs.select(bonus, seq_lens, seq_lens_cpu, torch.empty(bs, dtype=torch.int64, **meta),
                           params.temperature, any_sampled, None)
    chain = propose(bonus, scores, SpecShape(BLOCK, 1))
    assert chain.ids.shape == (bs, BLOCK) and chain.q.probs.shape == (bs, BLOCK - 1, 4)
    tree = propose(bonus, scores, SpecShape(7, 2))
    assert tree.tree.mask.shape == (bs, 7, 7)
    assert scores.ranks(chain.ids[:, 1:]).shape == (bs, BLOCK - 1)
    # the eager path (no captured size fits) with the hints, and without them: the device is read
    selector, logits = graphs.selection.selector, torch.empty(bs, BLOCK - 1, cfg.vocab_size, **meta)
    states = torch.empty(bs, BLOCK - 1, cfg.hidden_size, **meta)
    SelectorScores.of(selector, states, logits, bonus, params.temperature, None,
                      any_sampled=any_sampled).walk(BLOCK - 1)
    with pytest.raises((RuntimeError, NotImplementedError)):
        SelectorScores.of(selector, states, logits, bonus, params.temperature, None)


def test_graph_mode_follows_the_target():
    from dflash_sglang.adapter.draft.graphs import default_sizes, graph_mode

    from dflash_sglang.adapter.draft.attention import TorchPagedAttention

    torch_ = TorchPagedAttention(1.0)
    flashinfer = SimpleNamespace(name="flashinfer", capturable=True)  # a capturable backend (no GPU here)
    assert graph_mode("cpu", False, torch_) is None  # eager on the CPU
    assert graph_mode("cuda", False, flashinfer) is None  # follows the target (eager here: --disable-cuda-graph)
    assert graph_mode("cuda", True, flashinfer) == "capture"
    assert graph_mode("cuda", True, torch_) is None  # the torch reference reads layouts on the host
    assert graph_mode("cuda", True, None) is None  # dense path (a bidirectional window narrower than the block)
    assert graph_mode("cpu", False, torch_, "static") == "static"  # --speculative-dflash-draft-graphs static
    assert graph_mode("cuda", True, flashinfer, "static") == "static"
    assert graph_mode("cuda", True, flashinfer, "eager") is None
    with pytest.raises(ValueError, match="^--speculative-dflash-draft-graphs static: the drafter has a bidirectional"):
        graph_mode("cpu", False, None, "static")
    assert default_sizes(10) == [1, 2, 4, 8, 10] and default_sizes(4096)[-1] == 256


@pytest.mark.gpu
@requires_flashinfer_gpu
@pytest.mark.parametrize("draft", ["dflash", "gemma4"])
def test_captured_graphs_match_eager_on_gpu(draft):
    """Captured CUDA graphs (FlashInfer graph-mode wrappers, one per layer kind) against the eager pass and commit,
    same pool."""
    from dflash_sglang.adapter.draft.model import EagerDraftPass

    cfg, paged, head, r2t = _setup("cuda", torch.bfloat16, hidden=256, attention="flashinfer", draft=draft)  # d 64
    graphs = _graphs(paged, head, r2t, cfg, nodes=(3,), capture=True)
    eager = EagerDraftPass(paged, head, r2t)
    assert graphs.captured and all(g.graph is not None for g in graphs.drafts.values())
    for seq_lens, pool_idx in STEPS[:3]:
        bonus, sl, sl_cpu, idx = _step_inputs(seq_lens, pool_idx, cfg, "cuda")
        got = graphs(bonus, sl, sl_cpu, idx).float()
        want = eager(bonus, sl, sl_cpu, idx).float()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    _, eager, _, _ = _setup("cuda", torch.bfloat16, hidden=256, attention="flashinfer", draft=draft)
    rows = torch.arange(9, device="cuda")
    hidden = torch.randn(9, cfg.n_features * cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert graphs.commit(hidden, WIDTH + rows, 1 + rows * 7, bs=3, nodes=3)
    eager.commit(hidden, WIDTH + rows, 1 + rows * 7)
    ctx = slice(1, paged.scratch_base)  # the context rows (past slot 0; the draft passes above wrote scratch rows)
    torch.testing.assert_close(paged.pool.k[:, ctx], eager.pool.k[:, ctx])
    torch.testing.assert_close(paged.pool.v[:, ctx], eager.pool.v[:, ctx])


@pytest.mark.gpu
@requires_flashinfer_gpu
@pytest.mark.parametrize("draft", ["dflash2", "dflash2_full"])
@pytest.mark.parametrize("sampling", ["greedy", "mixed"])
def test_captured_dflash2_graphs_match_eager_on_gpu(sampling, draft):
    """A DFlash2 draft's pass, candidates and walk captured as CUDA graphs (a host sync anywhere in them fails the
    capture): each replay's selection equals the eager selection over the replay's own states and logits (candidates,
    walk and tree tokens equal; scores and q within float32 rounding), and the pass is the eager pass's up to bf16
    rounding."""
    from dflash_sglang.adapter.draft.model import EagerDraftPass
    from dflash_sglang.core.draft.selector import SelectorScores

    cfg, paged, head, r2t = _setup("cuda", torch.bfloat16, hidden=256, attention="flashinfer", draft=draft)
    top_logits = _top(cfg.vocab_size, 1)
    graphs = _graphs(paged, head, r2t, cfg, capture=True, top_logits=top_logits)
    eager = EagerDraftPass(paged, head, r2t)
    assert graphs.captured and all(g.graph is not None for g in graphs.drafts.values())
    gen_graph, gen_eager = (torch.Generator("cuda").manual_seed(7) for _ in range(2))
    for seq_lens, pool_idx in STEPS[:3]:
        bonus, sl, sl_cpu, idx = _step_inputs(seq_lens, pool_idx, cfg, "cuda")
        bs = len(seq_lens)
        temperature = (torch.tensor([(0.7, 0.0, 1.3)[i % 3] for i in range(bs)], device="cuda")
                       if sampling == "mixed" else None)
        got = graphs.select(bonus, sl, sl_cpu, idx, temperature, temperature is not None, gen_graph)
        s = graphs.drafts[graphs._size_for(bs)]
        want = SelectorScores.of(paged.drafter.candidate_selector, s.selection.states[:bs], s.logits[:bs], bonus,
                                 temperature, gen_eager, top_logits=top_logits, any_sampled=temperature is not None)
        _same_scores(got, want, bonus, exact=False)
        hidden, logits = eager.with_hidden(bonus, sl, sl_cpu, idx)
        torch.testing.assert_close(s.logits[:bs].float(), logits.float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(s.selection.states[:bs].float(), hidden.float(), rtol=3e-2, atol=3e-2)
