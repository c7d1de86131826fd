"""The draft pass and commit as static-buffer graphs (adapter/draft_graphs.py): padded replays equal the eager path
on mixed batches (CPU, static mode), the captured bodies do no host sync (meta tensors), mode selection; on a GPU,
captured CUDA graphs against the eager path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from factories import draft_config_for, tiny_drafter, tiny_target
from sglang_support import requires_flashinfer_gpu, requires_sglang

pytestmark = requires_sglang

BLOCK, REQ_SLOTS, WIDTH = 4, 6, 32
SIZES = (2, 4, 8)
# (seq_lens, request-pool slots) per step, replayed in this order: padded 3 -> 4, then 1 -> 2 over the stale
# statics of the larger batch, an exact fit, a batch no captured size holds (eager)
STEPS = [((5, 1, 12), (3, 0, 5)), ((7,), (2,)), ((9, 3, 1, 20), (1, 4, 0, 2)), ((2,) * 9, (0,) * 9)]


def _setup(device="cpu", dtype=torch.float32, hidden=32, attention="torch"):
    """A PagedDrafter over a pool with committed contexts for every request slot, its TargetHead, req_to_token."""
    from dflash_sglang.adapter.model import DraftKVPool, PagedDrafter, TargetHead

    cfg = draft_config_for(tiny_target("qwen3", hidden=hidden), block_size=BLOCK)
    torch.manual_seed(0)
    core = tiny_drafter(cfg).to(device, dtype)
    slots = 1 + REQ_SLOTS * WIDTH  # slot 0: SGLang's padding slot, never a request's
    req_to_token = (1 + torch.randperm(slots - 1)).view(REQ_SLOTS, WIDTH).to(torch.int32).to(device)
    pool = DraftKVPool(cfg.num_hidden_layers, slots + (REQ_SLOTS + 1) * BLOCK, cfg.num_key_value_heads,
                       cfg.head_dim, dtype, device)
    paged = PagedDrafter(core, pool, scratch_base=slots, block=BLOCK, pad_slot=REQ_SLOTS, attention=attention)
    for r in range(REQ_SLOTS):
        feats = torch.randn(WIDTH, cfg.n_features * cfg.hidden_size, device=device, dtype=dtype)
        paged.commit(feats, torch.arange(WIDTH, device=device), req_to_token[r].to(torch.int64))
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(device, dtype)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    head = TargetHead(embed, lm_head, cfg.mask_token_id, embed_scale=1.5)
    return cfg, paged, head, req_to_token


def _graphs(paged, head, req_to_token, cfg, nodes=(3,), capture=False):
    from dflash_sglang.adapter.draft_graphs import DraftGraphs

    return DraftGraphs(paged, head, req_to_token, SIZES, nodes, cfg.n_features * cfg.hidden_size,
                       paged.pool.k.dtype, capture=capture)


def _step_inputs(seq_lens, pool_idx, cfg, device="cpu"):
    g = torch.Generator().manual_seed(sum(seq_lens))
    bs = len(seq_lens)
    bonus = torch.randint(0, cfg.vocab_size, (bs,), generator=g)
    return bonus.to(device), torch.tensor(seq_lens, device=device), torch.tensor(seq_lens), torch.tensor(pool_idx,
                                                                                                          device=device)


def test_static_draft_replays_equal_eager_on_mixed_batches():
    from dflash_sglang.adapter.model import EagerDraftPass

    cfg, paged, head, r2t = _setup()
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
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        # the padded requests drafted in the padding slot's scratch, not in a slot a larger batch left behind
        assert graphs.drafts[graphs._size_for(len(seq_lens))].req_pool_indices[len(seq_lens):].eq(REQ_SLOTS).all()


def test_static_commit_replays_equal_eager():
    from dflash_sglang.adapter.draft_graphs import PAD_SLOT

    cfg, paged, head, r2t = _setup()
    _, eager, _, _ = _setup()
    graphs = _graphs(paged, head, r2t, cfg, nodes=(3,))
    feats = cfg.n_features * cfg.hidden_size
    for bs in (3, 1, 8):  # padded, padded over stale rows, exact
        rows = torch.arange(bs * 3)
        hidden = torch.randn(bs * 3, feats)
        positions, slots = WIDTH + rows, (1 + rows * 5) % (REQ_SLOTS * WIDTH)
        assert graphs.commit(hidden, positions, slots + 1, bs=bs, nodes=3)
        eager.commit(hidden, positions, slots + 1)
        # padded rows (over the stale rows of a larger batch) wrote SGLang's padding slot
        assert graphs.commits[(graphs._size_for(bs), 3)].slots[bs * 3:].eq(PAD_SLOT).all()
    assert not graphs.commit(hidden[:3], positions[:3], slots[:3], bs=3, nodes=1)  # no graph for 1 row / request
    real = torch.ones(paged.pool.rows, dtype=torch.bool)
    real[PAD_SLOT] = False  # padded rows wrote SGLang's padding slot, which no request reads
    for pool_a, pool_b in ((paged.pool.k, eager.pool.k), (paged.pool.v, eager.pool.v)):
        torch.testing.assert_close(pool_a[:, real], pool_b[:, real], rtol=1e-6, atol=1e-6)


class _MetaAttention:
    """A paged backend on the meta device: shapes only."""

    name = "meta"

    def for_graph(self, batch_size, kv_indptr_buf, kv_indices_buf):
        return self

    def plan(self, layout):
        pass

    def run(self, q, k_rows, v_rows):
        return torch.empty_like(q)


def test_captured_bodies_do_no_host_sync():
    """The bodies a CUDA graph captures, run on meta tensors (no data): any host read (.item(), .tolist(), a
    data-dependent shape such as a boolean mask's) raises there, as it would break a capture."""
    from dflash_sglang.adapter.draft_graphs import DraftGraphs
    from dflash_sglang.adapter.model import DraftKVPool, PagedDrafter, TargetHead, random_drafter

    cfg = draft_config_for(tiny_target("qwen3"), block_size=BLOCK)
    pool = DraftKVPool(cfg.num_hidden_layers, 64 + (REQ_SLOTS + 1) * BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                       torch.float32, "meta")
    paged = PagedDrafter(random_drafter(cfg, "meta", torch.float32), pool, 64, BLOCK, pad_slot=REQ_SLOTS)
    paged.attention = _MetaAttention()
    head = TargetHead(torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta"),
                      torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta"), cfg.mask_token_id)
    r2t = torch.empty(REQ_SLOTS, WIDTH, dtype=torch.int32, device="meta")
    graphs = DraftGraphs(paged, head, r2t, SIZES, (3, 1), cfg.n_features * cfg.hidden_size, torch.float32, False)
    for size in SIZES:
        graphs._draft_body(graphs.drafts[size])
        assert graphs.drafts[size].logits.shape == (size, BLOCK - 1, cfg.vocab_size)
        for nodes in (3, 1):
            graphs._commit_body(graphs.commits[(size, nodes)])
    with pytest.raises((RuntimeError, NotImplementedError)):  # the check has teeth: a host read fails on meta
        int(graphs.drafts[2].seq_lens.sum())


def test_graph_mode_follows_the_target():
    from dflash_sglang.adapter.draft_graphs import default_sizes, graph_mode

    from dflash_sglang.adapter.draft_attention import TorchPagedAttention

    torch_ = TorchPagedAttention(1.0)
    flashinfer = SimpleNamespace(name="flashinfer", capturable=True)  # a capturable backend (no GPU here)
    assert graph_mode("cpu", False, torch_) is None  # eager on the CPU
    assert graph_mode("cuda", False, flashinfer) is None  # follows the target (eager here: --disable-cuda-graph)
    assert graph_mode("cuda", True, flashinfer) == "capture"
    assert graph_mode("cuda", True, torch_) is None  # the torch reference reads layouts on the host
    assert graph_mode("cuda", True, None) is None  # dense path (causal / sliding-window layers)
    assert graph_mode("cpu", False, torch_, "static") == "static"  # --speculative-dflash-draft-graphs static
    assert graph_mode("cuda", True, flashinfer, "static") == "static"
    assert graph_mode("cuda", True, flashinfer, "eager") is None
    with pytest.raises(ValueError, match="^--speculative-dflash-draft-graphs static: the drafter has causal"):
        graph_mode("cpu", False, None, "static")
    assert default_sizes(10) == [1, 2, 4, 8, 10] and default_sizes(4096)[-1] == 256


@requires_flashinfer_gpu
def test_captured_graphs_match_eager_on_gpu():
    """Captured CUDA graphs (FlashInfer graph-mode wrappers) against the eager pass and commit, same pool."""
    from dflash_sglang.adapter.model import EagerDraftPass

    cfg, paged, head, r2t = _setup("cuda", torch.bfloat16, hidden=256, attention="flashinfer")  # head_dim 64
    graphs = _graphs(paged, head, r2t, cfg, nodes=(3,), capture=True)
    eager = EagerDraftPass(paged, head, r2t)
    assert graphs.captured and all(g.graph is not None for g in graphs.drafts.values())
    for seq_lens, pool_idx in STEPS[:3]:
        bonus, sl, sl_cpu, idx = _step_inputs(seq_lens, pool_idx, cfg, "cuda")
        got = graphs(bonus, sl, sl_cpu, idx).float()
        want = eager(bonus, sl, sl_cpu, idx).float()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    _, eager, _, _ = _setup("cuda", torch.bfloat16, hidden=256, attention="flashinfer")
    rows = torch.arange(9, device="cuda")
    hidden = torch.randn(9, cfg.n_features * cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert graphs.commit(hidden, WIDTH + rows, 1 + rows * 7, bs=3, nodes=3)
    eager.commit(hidden, WIDTH + rows, 1 + rows * 7)
    ctx = slice(1, paged.scratch_base)  # the context rows (past slot 0; the draft passes above wrote scratch rows)
    torch.testing.assert_close(paged.pool.k[:, ctx], eager.pool.k[:, ctx])
    torch.testing.assert_close(paged.pool.v[:, ctx], eager.pool.v[:, ctx])
