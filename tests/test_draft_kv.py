"""fp8 (and bf16) draft KV: the storage format (core/draft/draft_kv.py), the reference drafter reading through it
(core/draft/drafter.py `kv_format`), the SGLang pool and paged pass equal to it (adapter/draft/model.py,
adapter/draft/attention.py), greedy identity of the reference decoder, and the pool's memory accounting
(adapter/draft/memory.py)."""
from __future__ import annotations

import pytest
import torch

from dflash_sglang.core.draft.draft_kv import KV_DTYPES, DraftKVFormat, kv_format, parse_kv_dtype
from factories import draft_config_for, mixed_prompts, tiny_drafter, tiny_target
from sglang_support import requires_flashinfer_gpu, requires_sglang

FP8 = ("fp8_e4m3", "fp8_e5m2")
SEQ_LENS = (5, 1, 12, 7)  # mixed committed lengths
POOL_IDX = (3, 0, 5, 2)  # request-pool slots, not in batch order
BLOCK = 4


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# ---------------------------------------------------------------------------------------------- core
@pytest.mark.parametrize("name", [*FP8, "bf16"])
def test_a_stored_value_stores_again_unchanged(name):
    """With unit scales, a value read back from the store is stored exactly again (what lets the pool store the
    reference's already-read context K/V), and reading differs from the input (the format does something)."""
    fmt = DraftKVFormat(parse_kv_dtype(name))
    x = torch.randn(4, 2, 8) * 3
    k, v = fmt.roundtrip(x, x * 0.5)
    assert k.dtype == x.dtype and k.shape == x.shape
    assert torch.equal(fmt.roundtrip(k, v)[0], k) and torch.equal(fmt.roundtrip(k, v)[1], v)
    assert not torch.equal(k, x)
    # the storage is SGLang's: x / scale cast by torch, read back times scale
    scaled = DraftKVFormat(fmt.dtype, k_scale=2.0, v_scale=0.5)
    assert torch.equal(scaled.store(x, 2.0), (x / 2.0).to(fmt.dtype))
    assert torch.equal(scaled.load(scaled.store(x, 2.0), 2.0, torch.float32), (x / 2.0).to(fmt.dtype).float() * 2.0)


def test_kv_dtype_names():
    assert parse_kv_dtype(None) is None and parse_kv_dtype("auto") is None
    assert parse_kv_dtype("fp8_e4m3") == torch.float8_e4m3fn and parse_kv_dtype("fp8_e5m2") == torch.float8_e5m2
    with pytest.raises(ValueError, match="'nvfp4' is not a draft KV dtype"):
        parse_kv_dtype("nvfp4")
    assert kv_format("auto", torch.float32) is None and kv_format("bf16", torch.bfloat16) is None
    assert kv_format("bf16", torch.float32) == DraftKVFormat(torch.bfloat16)
    assert set(FP8) <= set(KV_DTYPES)


def test_reference_drafter_reads_context_and_block_as_stored():
    """The fp8 reference drafter is the drafter whose context and block K/V are quantized then read back: equal to
    running the layers with attends that round-trip both, and different from the unquantized drafter."""
    from dflash_sglang.core.draft.drafter import dense_attend

    cfg = draft_config_for(tiny_target("llama"), block_size=BLOCK)
    drafter = tiny_drafter(cfg)
    fmt = DraftKVFormat(torch.float8_e4m3fn)
    ctx, ctx_pos = torch.randn(2, 6, cfg.hidden_size), torch.arange(6).expand(2, 6)
    block, pos = torch.randn(2, BLOCK, cfg.hidden_size), torch.arange(6, 6 + BLOCK).expand(2, BLOCK)
    plain = drafter(block, pos, drafter.context_kv(ctx, ctx_pos), ctx_pos)
    raw_kv = drafter.context_kv(ctx, ctx_pos)
    drafter.kv_format = fmt
    try:
        got = drafter(block, pos, drafter.context_kv(ctx, ctx_pos), ctx_pos)
    finally:
        drafter.kv_format = None
    mask = torch.ones(2, 1, BLOCK, 6 + BLOCK, dtype=torch.bool)
    scale = cfg.head_dim ** -0.5

    def quantized(kv):
        inner = dense_attend(fmt.roundtrip(*kv), mask, drafter.attention, scale)
        return lambda q, k, v: inner(q, *fmt.roundtrip(k, v))

    want = drafter.run_layers(block, pos, [quantized(kv) for kv in raw_kv])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(got, plain, atol=1e-4)


@pytest.mark.parametrize("name", FP8)
def test_reference_decoder_with_fp8_draft_kv_is_lossless(name):
    """Greedy speculative decoding with an fp8 draft KV equals plain greedy decoding (mixed-length batch)."""
    from dflash_sglang.core.reference import ReferenceDecoder

    target = tiny_target("llama", vocab=96, seed=3)
    drafter = tiny_drafter(draft_config_for(target, block_size=BLOCK))
    drafter.kv_format = DraftKVFormat(parse_kv_dtype(name))
    prompts = mixed_prompts(96)
    dec = ReferenceDecoder(target, drafter)
    spec = dec.generate(prompts, 20, block_size=BLOCK)
    plain = dec.plain_generate(prompts, 20)
    assert [g.tokens for g in spec] == [p.tokens if hasattr(p, "tokens") else p for p in plain]


# ---------------------------------------------------------------------------------------------- adapter
def _req_to_token(slots_total: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randperm(slots_total, generator=g)[: 6 * 16].view(6, 16).to(torch.int32)


@requires_sglang
@pytest.mark.parametrize("name", [*FP8, "bf16"])
@pytest.mark.parametrize("layers", ["plain", "sliding"])
def test_paged_pass_over_a_quantized_pool_equals_the_reference_drafter(name, layers):
    """worker == reference: context committed into a pool stored in `name`, a mixed-length batch drafted through the
    paged pass (torch backend; a drafter with a causal sliding-window layer too) equals the reference drafter
    with that draft KV format on in-memory context."""
    from dflash_sglang.adapter.draft.pool import DraftKVPool
    from dflash_sglang.adapter.draft.model import PagedDrafter

    extra = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3) if layers == "sliding" else {}
    cfg = draft_config_for(tiny_target("llama" if extra else "qwen3"), block_size=BLOCK, **extra)
    torch.manual_seed(0)
    core, ref = tiny_drafter(cfg), tiny_drafter(cfg)
    ref.kv_format = kv_format(name, torch.float32)
    pool = DraftKVPool(cfg.num_hidden_layers, 200 + 6 * BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                       torch.float32, "cpu", ref.kv_format)
    assert pool.k.dtype == parse_kv_dtype(name) and pool.nbytes() == 2 * pool.k.numel() * pool.k.element_size()
    paged = PagedDrafter(core, pool, scratch_base=200, block=BLOCK, attention="torch")
    assert paged.attention is not None
    r2t = _req_to_token(200)
    feats = [torch.randn(n, cfg.n_features * cfg.hidden_size) for n in SEQ_LENS]
    for f, n, r in zip(feats, SEQ_LENS, POOL_IDX):
        paged.commit(f, torch.arange(n), r2t[r, :n].to(torch.int64))
    embeds = torch.randn(len(SEQ_LENS), BLOCK, cfg.hidden_size)
    positions = torch.tensor(SEQ_LENS)[:, None] + torch.arange(BLOCK)
    got = paged.draft(embeds, positions, r2t, torch.tensor(POOL_IDX), torch.tensor(SEQ_LENS))
    want, unquantized = [], []
    for i, (f, n) in enumerate(zip(feats, SEQ_LENS)):
        ctx_pos = torch.arange(n)[None]
        want.append(ref(embeds[i:i + 1], positions[i:i + 1], ref.context_kv(ref.fuse(f)[None], ctx_pos), ctx_pos)[0])
        ref.kv_format, fmt = None, ref.kv_format
        unquantized.append(ref(embeds[i:i + 1], positions[i:i + 1], ref.context_kv(ref.fuse(f)[None], ctx_pos),
                               ctx_pos)[0])
        ref.kv_format = fmt
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, torch.stack(unquantized), atol=1e-4)  # the pool's format is what made it differ


@requires_sglang
@pytest.mark.parametrize("name,element", [("auto", 4), ("bf16", 2), ("fp8_e4m3", 1), ("fp8_e5m2", 1)])
def test_draft_memory_counts_the_pool_row(name, element):
    """The bytes per token SGLang's sizing is told equal a row of the pool the worker allocates, for each dtype."""
    from dflash_sglang.adapter.draft.memory import check_pool_memory, draft_memory
    from dflash_sglang.adapter.draft.pool import DraftKVPool

    cfg = draft_config_for(tiny_target("qwen3"), block_size=BLOCK)
    memory = draft_memory(cfg, name, torch.float32)
    assert memory.bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element
    assert memory.bytes_per_request(1000) == 1000 * memory.bytes_per_token
    pool = DraftKVPool(cfg.num_hidden_layers, 100 + 3 * BLOCK, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                       "cpu", kv_format(name, torch.float32))
    line = check_pool_memory(pool, memory, 100, 1000)
    assert f"{memory.bytes_per_token} B/token" in line and "100 target slots" in line
    wrong = draft_memory(cfg, "bf16" if name != "bf16" else "fp8_e4m3", torch.float32)
    with pytest.raises(RuntimeError, match="a draft KV pool row costs"):
        check_pool_memory(pool, wrong, 100, 1000)


@requires_sglang
@pytest.mark.parametrize("window", [None, 8])
def test_start_up_lines_account_for_the_block_scratch(window):
    """The block scratch (a block of rows per request slot, past the context rows) is priced in both start-up lines,
    and each says whether SGLang's KV sizing counted it: not without a window (its sizing is per token), with a window
    yes (the rings and the scratch are allocated before it)."""
    from types import SimpleNamespace

    from dflash_sglang.adapter.draft.memory import check_pool_memory, draft_memory, human_bytes, sizing_line
    from dflash_sglang.adapter.draft.pool import new_pool, pool_rows

    cfg = draft_config_for(tiny_target("qwen3"), block_size=BLOCK)
    ring = window + BLOCK - 1 if window else 0
    memory = draft_memory(cfg, "auto", torch.float32, window, ring)
    req_slots = 5
    context = req_slots * ring if window else 100
    pool = new_pool(cfg, context, req_slots, BLOCK, torch.float32, "cpu")
    scratch = (pool_rows(context, req_slots, BLOCK) - context) * memory.bytes_per_row
    assert pool.nbytes() == (context + (req_slots + 1) * BLOCK) * memory.bytes_per_row
    line = check_pool_memory(pool, memory, context, 1000)
    per_slot = f"block scratch {BLOCK} rows = {human_bytes(BLOCK * memory.bytes_per_row)} per request slot"
    sized = sizing_line(768, 999, SimpleNamespace(draft_memory=memory, context_len=1000, block_size=BLOCK))
    assert sized.startswith(f"KV sizing at {768 + memory.bytes_per_token} B/token = target 768 + draft KV float32: ")
    assert per_slot in sized and "(SGLang's estimate: 999)" in sized
    if window is None:
        assert f"100 target slots, counted by SGLang's KV sizing per token, + {human_bytes(scratch)} block scratch, " \
               f"not counted" in line, line
        assert "not in SGLang's per-token KV sizing" in sized, sized
    else:
        assert f"{req_slots} request slots x {ring} ring rows, allocated before SGLang's KV sizing with their " \
               f"{human_bytes(scratch)} block scratch: all counted by it" in line, line
        assert "allocated with the rings before SGLang's KV sizing, which counts both" in sized, sized


# ---------------------------------------------------------------------------------------------- GPU (FlashInfer)
@requires_sglang
@pytest.mark.gpu
@requires_flashinfer_gpu
@pytest.mark.parametrize("name", FP8)
def test_flashinfer_reads_an_fp8_pool_as_the_reference(name):
    """FlashInfer planned with the fp8 KV data type (bf16 queries) == the torch reference dequantizing the same fp8
    rows, on a ragged batch over a shuffled pool (contexts 1..1000, GQA 8/2, head_dim 64)."""
    from dflash_sglang.adapter.draft.attention import FlashInferPagedAttention, paged_attention_reference
    from dflash_sglang.adapter.draft.context_rows import SlotRows

    torch.manual_seed(0)
    fmt = DraftKVFormat(parse_kv_dtype(name))
    h, kvh, d, scratch = 8, 2, 64, 8 * BLOCK
    rows = 8 * 1024 + scratch
    seq_lens = torch.tensor([1, 37, 300, 129, 2, 1000])
    r2t = torch.randperm(rows - scratch, device="cuda").view(8, 1024).to(torch.int32)
    layout = SlotRows(rows - scratch).layout(r2t, torch.tensor([7, 0, 3, 5, 1, 2], device="cuda"), seq_lens, seq_lens,
                                             BLOCK, rows - scratch)
    k = fmt.store(torch.randn(rows, kvh, d, device="cuda"), 1.0)
    v = fmt.store(torch.randn(rows, kvh, d, device="cuda"), 1.0)
    q = torch.randn(len(seq_lens) * BLOCK, h, d, device="cuda", dtype=torch.bfloat16)
    fi = FlashInferPagedAttention(h, kvh, d, torch.bfloat16, "cuda", d**-0.5, kv_format=fmt)
    fi.plan(layout)
    got = fi.run(q, k, v)
    want = paged_attention_reference(q.float(), k, v, layout, d**-0.5, fmt)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
