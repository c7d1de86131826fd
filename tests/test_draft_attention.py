"""The drafter's paged attention (adapter/draft/attention.py, adapter/draft/model.py): layout indices, the paged pass
against the core drafter on in-memory context, backend selection; FlashInfer vs the torch reference on a GPU."""
from __future__ import annotations

import pytest
import torch

from factories import DFLASH2_DRAFT, GEMMA4_DRAFT, draft_config_for, tiny_drafter, tiny_target
from sglang_support import requires_flashinfer_gpu, requires_sglang

pytestmark = requires_sglang

SEQ_LENS = (5, 1, 12, 7)  # mixed committed lengths
POOL_IDX = (3, 0, 5, 2)  # request-pool slots, not in batch order
BLOCK = 4
# Drafts whose layers narrow what their queries see (core/draft/config.py LayerKind), every window shorter than most of
# SEQ_LENS: DFlash v1 Gemma-4 style (causal sliding-window layers, then a full one), every layer causal (speculators
# drafts), DFlash2 (bidirectional sliding-window layers) with a window of the block size and one narrower than it.
NARROWING = {
    "gemma4": {**GEMMA4_DRAFT, "sliding_window": 3},
    "causal": {"is_causal": True},
    "dflash2": {**DFLASH2_DRAFT, "sliding_window": BLOCK},
    "dflash2_narrow": {**DFLASH2_DRAFT, "sliding_window": 3},
}


def _req_to_token(slots_total: int, seed: int = 0) -> torch.Tensor:
    """[6 pool reqs, 16] int32: every request's context slots, disjoint, shuffled over the KV pool."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(slots_total, generator=g)[: 6 * 16].view(6, 16).to(torch.int32)


def test_layout_indices():
    from dflash_sglang.adapter.draft.context_rows import SlotRows

    r2t = _req_to_token(200)
    layout = SlotRows(200).layout(r2t, torch.tensor(POOL_IDX), torch.tensor(SEQ_LENS), torch.tensor(SEQ_LENS), BLOCK,
                                  scratch_base=200)
    assert layout.qo_indptr_cpu.tolist() == [0, 4, 8, 12, 16]
    assert layout.kv_indptr_cpu.tolist() == [0, 9, 14, 30, 41]
    kv = layout.kv_indices.tolist()
    for i, (n, r) in enumerate(zip(SEQ_LENS, POOL_IDX)):
        seg = kv[layout.kv_indptr_cpu[i]:layout.kv_indptr_cpu[i + 1]]
        scratch = [200 + r * BLOCK + j for j in range(BLOCK)]
        assert seg == r2t[r, :n].tolist() + scratch
    assert layout.kv_indices.dtype == torch.int32


def _paged_vs_core(cfg, backend: str = "torch", block: int = BLOCK):
    """Commit random context features into a PagedDrafter's pool, draft a mixed-length batch through the paged
    path (a pass of `block` <= B rows), and draft the same batch with the core drafter on in-memory context. Returns
    both [bs, block, H]."""
    from dflash_sglang.adapter.draft.pool import DraftKVPool
    from dflash_sglang.adapter.draft.model import PagedDrafter

    torch.manual_seed(0)
    core = tiny_drafter(cfg)
    r2t = _req_to_token(200)
    pool = DraftKVPool(cfg.num_hidden_layers, 200 + 6 * BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                       torch.float32, "cpu")
    paged = PagedDrafter(core, pool, scratch_base=200, block=BLOCK, attention=backend)
    hidden = cfg.hidden_size
    feats = [torch.randn(n, cfg.n_features * hidden) for n in SEQ_LENS]
    for f, n, r in zip(feats, SEQ_LENS, POOL_IDX):
        paged.commit(f, torch.arange(n), r2t[r, :n].to(torch.int64))
    embeds = torch.randn(len(SEQ_LENS), block, hidden)
    positions = torch.tensor(SEQ_LENS)[:, None] + torch.arange(block)
    got = paged.draft(embeds, positions, r2t, torch.tensor(POOL_IDX), torch.tensor(SEQ_LENS))
    want = []
    with torch.no_grad():
        for i, (f, n) in enumerate(zip(feats, SEQ_LENS)):
            ctx_pos = torch.arange(n)[None]
            ctx_kv = core.context_kv(core.fuse(f)[None], ctx_pos)
            want.append(core(embeds[i:i + 1], positions[i:i + 1], ctx_kv, ctx_pos)[0])
    return paged, got, torch.stack(want)


def test_paged_pass_equals_core_drafter():
    cfg = draft_config_for(tiny_target("qwen3"), block_size=BLOCK)
    paged, got, want = _paged_vs_core(cfg)
    assert paged.backend_name == "paged torch"
    # each request's block K/V go to its request-pool slot's scratch rows, the rows its layout segment ends with
    rows = paged.scratch_rows(torch.tensor(POOL_IDX))
    assert rows.tolist() == [200 + r * BLOCK + j for r in POOL_IDX for j in range(BLOCK)] and rows.dtype == torch.int64
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [2, 3])
def test_a_shorter_pass_equals_the_core_drafter_on_that_block(block):
    """A short chain drafts [bonus, MASK x (b-1)] (core/speculate.py `draft_block`): the paged pass packs its b rows
    per request in the scratch at stride b and matches the core drafter run on the same b-row block."""
    cfg = draft_config_for(tiny_target("qwen3"), block_size=BLOCK)
    paged, got, want = _paged_vs_core(cfg, block=block)
    assert got.shape[1] == block
    rows = paged.scratch_rows(torch.tensor(POOL_IDX), block)
    assert rows.tolist() == [200 + r * block + j for r in POOL_IDX for j in range(block)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [BLOCK, 3])
@pytest.mark.parametrize("layout", sorted(NARROWING))
def test_paged_pass_of_narrowing_layers_equals_core_drafter(layout, block):
    """Causal and sliding-window layers on the paged path (one plan per layer kind: each request's key range and mask)
    equal the core drafter's dense masks on a mixed-length batch whose contexts outrun the window (and on a short
    pass's b-row block)."""
    cfg = draft_config_for(tiny_target("llama"), block_size=BLOCK, **NARROWING[layout])
    assert any(cfg.layer_kind(i).narrows for i in range(cfg.num_hidden_layers))
    paged, got, want = _paged_vs_core(cfg, block=block)
    assert paged.attention is not None and paged.backend_name.startswith("paged torch (")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_key_ranges_cut_and_mask_as_the_kind_says():
    """The torch backend's per-kind keys of each request: a window cuts the keys no query reaches and masks the rest
    by position (end-aligned: query j of a request with L context rows is at L + j)."""
    from dflash_sglang.adapter.draft.attention import DraftLayout, host_indptrs, key_ranges
    from dflash_sglang.core.draft.config import LayerKind

    qo, kv = host_indptrs(torch.tensor([5, 0]), 3)
    layout = DraftLayout(qo, kv, torch.zeros(int(kv[-1]), dtype=torch.int32))
    both, causal = key_ranges(layout, LayerKind(False, 3), "cpu"), key_ranges(layout, LayerKind(True, 3), "cpu")
    assert [r.start for r in both] == [3, 0] and [r.start for r in causal] == [3, 0]
    # request 0: queries at positions 5, 6, 7 over keys 3..7; keys within 2 positions either side (or behind only)
    assert both[0].mask.int().tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert causal[0].mask.int().tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert key_ranges(layout, LayerKind(), "cpu")[0].mask is None  # a full layer: all keys, no mask
    assert both[1].mask is None  # no context, a 3-row block inside a window of 3: every key visible


def test_a_backend_that_cannot_express_a_kind_leaves_the_dense_path(monkeypatch):
    """FlashInfer cannot hide block keys to the right of a query: a bidirectional window narrower than the block runs
    on the dense path (eager), which equals the core drafter, and the start-up line says why. Shown with the torch
    backend made to answer as FlashInfer does."""
    from dflash_sglang.adapter.draft.attention import FlashInferPagedAttention, TorchPagedAttention
    from dflash_sglang.core.draft.config import LayerKind

    expresses = FlashInferPagedAttention.expresses
    assert expresses(LayerKind(False, BLOCK), BLOCK) and expresses(LayerKind(True, 1), BLOCK)
    assert expresses(LayerKind(True, None), BLOCK) and not expresses(LayerKind(False, BLOCK - 1), BLOCK)
    monkeypatch.setattr(TorchPagedAttention, "expresses", staticmethod(expresses))
    cfg = draft_config_for(tiny_target("llama"), block_size=BLOCK, **NARROWING["dflash2_narrow"])
    paged, got, want = _paged_vs_core(cfg)
    assert paged.attention is None and paged.backend_name.startswith("dense (sliding-window 3 layers): the paged")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wide = draft_config_for(tiny_target("llama"), block_size=BLOCK, **NARROWING["dflash2"])
    assert _paged_vs_core(wide)[0].attention is not None


def test_backend_selection():
    from dflash_sglang.adapter.draft.attention import TorchPagedAttention, select_backend

    with pytest.raises(ValueError, match="^--speculative-draft-attention-backend flashinfer needs a CUDA device"):
        select_backend("cpu", 4, 2, 8, torch.float32, "flashinfer")
    for choice in ("auto", "torch"):
        assert isinstance(select_backend("cpu", 4, 2, 8, torch.float32, choice), TorchPagedAttention)


def _random_case(device: str, dtype: torch.dtype):
    """A ragged batch over a shuffled pool (contexts 1..1000 rows, GQA 8/2, head_dim 64): q, k, v, layout."""
    from dflash_sglang.adapter.draft.context_rows import SlotRows

    torch.manual_seed(0)
    h, kvh, d = 8, 2, 64
    scratch = 8 * BLOCK
    rows = 8 * 1024 + scratch
    seq_lens = torch.tensor([1, 37, 300, 129, 2, 1000])
    pool_idx = torch.tensor([7, 0, 3, 5, 1, 2], device=device)
    r2t = torch.randperm(rows - scratch, device=device).view(8, 1024).to(torch.int32)
    layout = SlotRows(rows - scratch).layout(r2t, pool_idx, seq_lens, seq_lens, BLOCK, scratch_base=rows - scratch)
    k = torch.randn(rows, kvh, d, device=device, dtype=dtype)
    v = torch.randn(rows, kvh, d, device=device, dtype=dtype)
    q = torch.randn(len(seq_lens) * BLOCK, h, d, device=device, dtype=dtype)
    return q, k, v, layout


# Layer kinds of the GPU check, as (causal, window): full (DFlash), bidirectional sliding windows (DFlash2: the
# published 2048, one shorter than most contexts, one of the block size), causal ones (Gemma-4 DFlash, speculators).
KINDS = [(False, None), (False, 2048), (False, 64), (False, BLOCK), (True, None), (True, 16), (True, 1)]


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_reference_equals_explicit_softmax(kind):
    """The reference on the GPU test's case, against attention written out by hand (CPU, float64): every key of the
    request's segment scored, those the kind hides (by end-aligned position) set to -inf."""
    from dflash_sglang.adapter.draft.attention import key_ranges, paged_attention_reference
    from dflash_sglang.core.draft.config import LayerKind

    kind = LayerKind(*kind)
    q, k, v, layout = _random_case("cpu", torch.float64)
    got = paged_attention_reference(q, k, v, layout, 0.125, ranges=key_ranges(layout, kind, "cpu"))
    kv, qo = layout.kv_indptr_cpu.tolist(), layout.qo_indptr_cpu.tolist()
    for i in range(layout.batch_size):
        rows = layout.kv_indices[kv[i]:kv[i + 1]].long()
        kk, vv = k[rows].repeat_interleave(4, dim=1), v[rows].repeat_interleave(4, dim=1)  # [K, h, d]
        qq = q[qo[i]:qo[i + 1]]  # [B, h, d]
        q_pos = torch.arange(len(rows) - len(qq), len(rows))  # the block rows' positions (= key indices)
        delta = q_pos[:, None] - torch.arange(len(rows))[None, :]
        hide = (delta < 0) if kind.causal else torch.zeros_like(delta, dtype=torch.bool)
        if kind.window is not None:
            hide |= delta.abs() >= kind.window
        scores = (torch.einsum("qhd,khd->hqk", qq, kk) * 0.125).masked_fill(hide, float("-inf"))
        torch.testing.assert_close(got[qo[i]:qo[i + 1]], torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))


@pytest.mark.gpu
@requires_flashinfer_gpu
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_reference_on_gpu(dtype, kind):
    """FlashInfer planned for each layer kind (causal, window_left) against the torch reference's key ranges and masks,
    on ragged contexts of 1..1000 rows; all the kinds planned on one backend at once, as a drafter's are."""
    from dflash_sglang.adapter.draft.attention import FlashInferPagedAttention, key_ranges, paged_attention_reference
    from dflash_sglang.core.draft.config import LayerKind

    kinds = [LayerKind(*c) for c in KINDS]
    q, k, v, layout = _random_case("cuda", dtype)
    d = q.shape[-1]
    fi = FlashInferPagedAttention(q.shape[1], k.shape[1], d, dtype, "cuda", d**-0.5, kinds=kinds)
    fi.plan(layout)
    got = fi.run(q, k, v, LayerKind(*kind))
    want = paged_attention_reference(q.float(), k.float(), v.float(), layout, d**-0.5,
                                     ranges=key_ranges(layout, LayerKind(*kind), "cuda"))
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@requires_flashinfer_gpu
@pytest.mark.parametrize("layout", ["full", "gemma4", "dflash2"])
@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_paged_drafter_flashinfer_equals_torch_on_gpu(kv_dtype, layout):
    """The whole paged pass on the GPU: FlashInfer backend vs the torch backend, same pool and layout (the pool in
    the model dtype, or fp8 draft KV: core/draft/draft_kv.py), full layers or narrowing ones (one plan per layer
    kind)."""
    cfg = draft_config_for(tiny_target("qwen3", hidden=256), block_size=BLOCK,  # head_dim 64
                           **NARROWING.get(layout, {}))
    from dflash_sglang.adapter.draft.model import PagedDrafter
    from dflash_sglang.adapter.draft.pool import DraftKVPool
    from dflash_sglang.core.draft.draft_kv import kv_format

    torch.manual_seed(0)
    core = tiny_drafter(cfg).cuda().to(torch.bfloat16)
    r2t = _req_to_token(200).cuda()
    pool = DraftKVPool(cfg.num_hidden_layers, 200 + 6 * BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                       torch.bfloat16, "cuda", kv_format(kv_dtype, torch.bfloat16) if kv_dtype else None)
    outs = {}
    for backend in ("torch", "flashinfer"):
        paged = PagedDrafter(core, pool, scratch_base=200, block=BLOCK, attention=backend)
        assert paged.backend_name.startswith(f"paged {backend}")
        for n, r in zip(SEQ_LENS, POOL_IDX):
            torch.manual_seed(n)
            paged.commit(torch.randn(n, cfg.n_features * cfg.hidden_size, device="cuda"), torch.arange(n).cuda(),
                         r2t[r, :n].to(torch.int64))
        torch.manual_seed(1)
        embeds = torch.randn(len(SEQ_LENS), BLOCK, cfg.hidden_size, device="cuda")
        positions = (torch.tensor(SEQ_LENS)[:, None] + torch.arange(BLOCK)).cuda()
        outs[backend] = paged.draft(embeds, positions, r2t, torch.tensor(POOL_IDX).cuda(),
                                    torch.tensor(SEQ_LENS).cuda()).float()
    torch.testing.assert_close(outs["flashinfer"], outs["torch"], rtol=3e-2, atol=3e-2)
