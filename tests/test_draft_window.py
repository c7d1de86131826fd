"""The drafter's sliding context window (core/drafter.py `context_window`, the definition of
`--speculative-draft-window-size W`): a block at committed length L reads only context positions L-W .. L-1."""
from __future__ import annotations

import pytest
import torch

from factories import draft_config_for, mixed_prompts, tiny_drafter, tiny_target

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
