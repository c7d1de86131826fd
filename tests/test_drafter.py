from dataclasses import replace

import pytest
import torch

from dflash_sglang.core.draft.drafter import dense_attend
from dflash_sglang.core.draft.features import target_layer_features
from factories import draft_config_for, tiny_drafter, tiny_target

@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # scoped: a module-level set_grad_enabled(False) would leak into later test files
        yield


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(draft_config_for(tiny_target("llama")))


def _run(drafter, ctx, ctx_pos, block, pos, ctx_valid=None, mask=None):
    kv = drafter.context_kv(ctx, ctx_pos)
    return drafter(block, pos, kv, ctx_pos, ctx_valid=ctx_valid, mask=mask)


def test_padding_rows_are_ignored(drafter):
    """A left-padded batch row gives the same block output as the same request alone."""
    H, B = 32, 8
    ctx = torch.randn(1, 5, H)
    block = torch.randn(1, B, H)
    ctx_pos = torch.arange(5)[None]
    pos = torch.arange(5, 5 + B)[None]
    alone = _run(drafter, ctx, ctx_pos, block, pos)
    padded_ctx = torch.cat([torch.randn(1, 3, H) * 100, ctx], dim=1)
    padded_pos = torch.cat([torch.zeros(1, 3, dtype=torch.long), ctx_pos], dim=1)
    valid = torch.tensor([[False] * 3 + [True] * 5])
    batched = _run(drafter, padded_ctx, padded_pos, block, pos, ctx_valid=valid)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_rope_is_relative(drafter):
    """Shifting every position by a constant leaves outputs unchanged (RoPE on q and both k parts)."""
    ctx, block = torch.randn(2, 6, 32), torch.randn(2, 8, 32)
    ctx_pos = torch.arange(6).expand(2, 6)
    pos = torch.arange(6, 14).expand(2, 8)
    a = _run(drafter, ctx, ctx_pos, block, pos)
    b = _run(drafter, ctx, ctx_pos + 37, block, pos + 37)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    c = _run(drafter, ctx, ctx_pos + 3, block, pos)  # context moved relative to the block: must change
    assert not torch.allclose(a, c, atol=1e-3)


def test_block_is_bidirectional(drafter):
    ctx, block = torch.randn(1, 4, 32), torch.randn(1, 8, 32)
    ctx_pos, pos = torch.arange(4)[None], torch.arange(4, 12)[None]
    a = _run(drafter, ctx, ctx_pos, block, pos)
    block2 = block.clone()
    block2[:, -1] += 1.0
    b = _run(drafter, ctx, ctx_pos, block2, pos)
    assert not torch.allclose(a[:, 0], b[:, 0], atol=1e-4)  # the first row sees the last one


def test_training_mask_equals_separate_blocks(drafter):
    """Flattened blocks with an explicit mask == each block alone with context strictly before its anchor."""
    H, B, S = 32, 8, 10
    ctx = torch.randn(1, S, H)
    ctx_pos = torch.arange(S)[None]
    anchors = [3, 7]
    blocks = [torch.randn(1, B, H) for _ in anchors]
    poss = [torch.arange(a, a + B)[None] for a in anchors]
    q = len(anchors) * B
    mask = torch.zeros(1, q, S + q, dtype=torch.bool)
    for i, a in enumerate(anchors):
        mask[0, i * B:(i + 1) * B, :a] = True
        mask[0, i * B:(i + 1) * B, S + i * B:S + (i + 1) * B] = True
    joint = _run(drafter, ctx, ctx_pos, torch.cat(blocks, 1), torch.cat(poss, 1), mask=mask)
    for i, a in enumerate(anchors):
        alone = _run(drafter, ctx[:, :a], ctx_pos[:, :a], blocks[i], poss[i])
        torch.testing.assert_close(joint[:, i * B:(i + 1) * B], alone, rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_context():
    target = tiny_target("llama")
    cfg = draft_config_for(target, n_layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    d_sliding = tiny_drafter(cfg)
    d_full = tiny_drafter(replace(cfg, layer_types=("full_attention",) * 2, sliding_window=None))
    ctx, block = torch.randn(1, 12, 32), torch.randn(1, 4, 32)
    ctx_pos, pos = torch.arange(12)[None], torch.arange(12, 16)[None]
    ctx2 = ctx.clone()
    ctx2[:, 0] += 5.0  # far outside the window of every block row
    # only the first layer is sliding; its effect on the first layer's output is what we can isolate:
    kv1, kv2 = d_sliding.context_kv(ctx, ctx_pos), d_sliding.context_kv(ctx2, ctx_pos)
    layer = d_sliding.layers[0]
    masks = d_sliding._layer_masks(torch.ones(1, 4, 16, dtype=torch.bool), pos, torch.cat([ctx_pos, pos], 1))
    cos, sin = d_sliding.rotary(pos, torch.float32)
    scale = cfg.head_dim**-0.5
    h1 = layer(block, cos, sin, dense_attend(kv1[0], masks[0], d_sliding.attention, scale))
    h2 = layer(block, cos, sin, dense_attend(kv2[0], masks[0], d_sliding.attention, scale))
    torch.testing.assert_close(h1, h2)
    assert masks[0][0, 0, 0, 12] and not masks[0][0, 0, 0, 13]  # sliding layers are causal by default
    assert not torch.allclose(_run(d_full, ctx, ctx_pos, block, pos), _run(d_full, ctx2, ctx_pos, block, pos))


def test_layer_id_offset():
    hs = tuple(torch.full((1, 2, 3), float(i)) for i in range(5))  # embeddings + 4 layers
    feats = target_layer_features(hs, [0, 3])
    assert feats[0, 0].tolist() == [1.0] * 3 + [4.0] * 3  # id i is hidden_states[i + 1]
    with pytest.raises(ValueError, match="out of range"):
        target_layer_features(hs, [4])


def test_rope_stays_float32_in_bf16_drafts():
    d = tiny_drafter(draft_config_for(tiny_target("llama"))).to(torch.bfloat16)
    assert d.rotary.inv_freq.dtype == torch.float32
    cos, _ = d.rotary(torch.tensor([[40000]]), torch.float32)
    ref = torch.cos(40000 * d.rotary.inv_freq.double())
    torch.testing.assert_close(cos[0, 0, 0, : ref.numel()].double(), ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_soft_capped_logits(scale):
    """A Gemma 4-style draft soft-caps its logits, tanh(l / cap) * cap, in place into a buffer or not; a Muse
    Glimmer-style one scales them first (output_multiplier)."""
    target = tiny_target("llama", vocab=16, seed=0)
    capped = tiny_drafter(draft_config_for(target, final_logit_softcapping=2.0, output_multiplier=scale), seed=1)
    hidden = torch.randn(3, 5, capped.cfg.hidden_size) * 4
    head = target.get_output_embeddings().weight
    raw = hidden @ head.t()
    want = torch.tanh(raw * scale / 2.0) * 2.0
    assert raw.abs().max() > 4  # the cap bites
    torch.testing.assert_close(capped.logits(hidden, head), want)
    out = torch.empty_like(raw)
    assert capped.logits(hidden, head, out=out) is out
    torch.testing.assert_close(out, want)
