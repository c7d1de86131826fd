"""The drafter's paged attention (adapter/draft_attention.py, adapter/model.py): layout indices, the paged pass
against the core drafter on in-memory context, backend selection; FlashInfer vs the torch reference on a GPU."""
from __future__ import annotations

import pytest
import torch

from factories import draft_config_for, tiny_drafter, tiny_target
from sglang_support import requires_flashinfer_gpu, requires_sglang

pytestmark = requires_sglang

SEQ_LENS = (5, 1, 12, 7)  # mixed committed lengths
POOL_IDX = (3, 0, 5, 2)  # request-pool slots, not in batch order
BLOCK = 4


def _req_to_token(slots_total: int, seed: int = 0) -> torch.Tensor:
    """[6 pool reqs, 16] int32: every request's context slots, disjoint, shuffled over the KV pool."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(slots_total, generator=g)[: 6 * 16].view(6, 16).to(torch.int32)


def test_layout_indices():
    from dflash_sglang.adapter.draft_attention import build_layout

    r2t = _req_to_token(200)
    layout = build_layout(r2t, torch.tensor(POOL_IDX), torch.tensor(SEQ_LENS), BLOCK, scratch_base=200)
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
    from dflash_sglang.adapter.model import DraftKVPool, PagedDrafter

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
    assert paged.backend_name == "torch"
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


def test_sliding_window_drafter_takes_dense_path():
    cfg = draft_config_for(tiny_target("llama"), block_size=BLOCK,
                           layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    paged, got, want = _paged_vs_core(cfg)
    assert paged.attention is None and paged.backend_name.startswith("dense")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backend_selection():
    from dflash_sglang.adapter.draft_attention import TorchPagedAttention, select_backend

    with pytest.raises(ValueError, match="^--speculative-draft-attention-backend flashinfer needs a CUDA device"):
        select_backend("cpu", 4, 2, 8, torch.float32, "flashinfer")
    for choice in ("auto", "torch"):
        assert isinstance(select_backend("cpu", 4, 2, 8, torch.float32, choice), TorchPagedAttention)


def _random_case(device: str, dtype: torch.dtype):
    """A ragged batch over a shuffled pool (contexts 1..1000 rows, GQA 8/2, head_dim 64): q, k, v, layout."""
    from dflash_sglang.adapter.draft_attention import build_layout

    torch.manual_seed(0)
    h, kvh, d = 8, 2, 64
    scratch = 8 * BLOCK
    rows = 8 * 1024 + scratch
    seq_lens = torch.tensor([1, 37, 300, 129, 2, 1000])
    pool_idx = torch.tensor([7, 0, 3, 5, 1, 2], device=device)
    r2t = torch.randperm(rows - scratch, device=device).view(8, 1024).to(torch.int32)
    layout = build_layout(r2t, pool_idx, seq_lens, BLOCK, scratch_base=rows - scratch)
    k = torch.randn(rows, kvh, d, device=device, dtype=dtype)
    v = torch.randn(rows, kvh, d, device=device, dtype=dtype)
    q = torch.randn(len(seq_lens) * BLOCK, h, d, device=device, dtype=dtype)
    return q, k, v, layout


def test_reference_equals_explicit_softmax():
    """The reference on the GPU test's case, against attention written out by hand (CPU, float64)."""
    from dflash_sglang.adapter.draft_attention import paged_attention_reference

    q, k, v, layout = _random_case("cpu", torch.float64)
    got = paged_attention_reference(q, k, v, layout, 0.125)
    kv, qo = layout.kv_indptr_cpu.tolist(), layout.qo_indptr_cpu.tolist()
    for i in range(layout.batch_size):
        rows = layout.kv_indices[kv[i]:kv[i + 1]].long()
        kk, vv = k[rows].repeat_interleave(4, dim=1), v[rows].repeat_interleave(4, dim=1)  # [K, h, d]
        qq = q[qo[i]:qo[i + 1]]  # [B, h, d]
        w = torch.softmax(torch.einsum("qhd,khd->hqk", qq, kk) * 0.125, dim=-1)
        torch.testing.assert_close(got[qo[i]:qo[i + 1]], torch.einsum("hqk,khd->qhd", w, vv))


@requires_flashinfer_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_reference_on_gpu(dtype):
    from dflash_sglang.adapter.draft_attention import FlashInferPagedAttention, paged_attention_reference

    q, k, v, layout = _random_case("cuda", dtype)
    d = q.shape[-1]
    fi = FlashInferPagedAttention(q.shape[1], k.shape[1], d, dtype, "cuda", d**-0.5)
    fi.plan(layout)
    got = fi.run(q, k, v)
    want = paged_attention_reference(q.float(), k.float(), v.float(), layout, d**-0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@requires_flashinfer_gpu
@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_paged_drafter_flashinfer_equals_torch_on_gpu(kv_dtype):
    """The whole paged pass on the GPU: FlashInfer backend vs the torch backend, same pool and layout (the pool in
    the model dtype, or fp8 draft KV: core/draft_kv.py)."""
    cfg = draft_config_for(tiny_target("qwen3", hidden=256), block_size=BLOCK)  # head_dim 64
    from dflash_sglang.adapter.model import DraftKVPool, PagedDrafter
    from dflash_sglang.core.draft_kv import kv_format

    torch.manual_seed(0)
    core = tiny_drafter(cfg).cuda().to(torch.bfloat16)
    r2t = _req_to_token(200).cuda()
    pool = DraftKVPool(cfg.num_hidden_layers, 200 + 6 * BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                       torch.bfloat16, "cuda", kv_format(kv_dtype, torch.bfloat16) if kv_dtype else None)
    outs = {}
    for backend in ("torch", "flashinfer"):
        paged = PagedDrafter(core, pool, scratch_base=200, block=BLOCK, attention=backend)
        assert paged.backend_name == backend
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
