"""core/step/vocab_parallel.py: candidates merged across vocabulary shards equal the full-vocabulary argmax / top-k."""
from __future__ import annotations

import pytest
import torch

from dflash_sglang.core.speculate import draft_topk
from dflash_sglang.core.step.vocab_parallel import VocabShard, local_candidates, local_top, merge_candidates, \
    merge_top, ordered_topk


def shards(logits: torch.Tensor, ranks: int, pad: int):
    """The full logits [..., V] split like a vocab-parallel lm_head: contiguous ranges of ceil(V / ranks) ids, the
    last one short, each padded with `pad` garbage rows (what SGLang's padded shards hold)."""
    vocab = logits.shape[-1]
    per = -(-vocab // ranks)
    out = []
    for r in range(ranks):
        start, stop = min(r * per, vocab), min((r + 1) * per, vocab)
        local = logits[..., start:stop]
        garbage = torch.full((*logits.shape[:-1], pad + per - (stop - start)), 1e4)  # must never win
        out.append((torch.cat([local, garbage], dim=-1), VocabShard(start, stop - start)))
    return out


def tied_logits(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Logits on a coarse grid (as bf16 logits are): most positions' top-k hold ties, some across shards; -0.0 beside
    +0.0 and -inf rows (past a soft cap, masked) too."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g) * 2).round() / 2
    logits[logits == 0] = torch.where(torch.rand(int((logits == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    logits[..., 5] = float("-inf")
    return logits


def lowest_id_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: a stable descending sort (ties keep id order), its first k -> (values, ids)."""
    values, ids = torch.sort(logits + 0.0, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def test_ordered_topk_breaks_ties_to_the_lowest_index():
    logits = tied_logits((4, 6, 37), seed=1)
    for k in (2, 4, 16, 37):
        values, ids = ordered_topk(logits, k)
        want_values, want_ids = lowest_id_topk(logits, k)
        assert torch.equal(ids, want_ids) and torch.equal(values, want_values)


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_merged_top_logits_equal_one_process_including_ties(ranks, k):
    """`merge_top` (a DFlash2 selector's candidates under TP): the same ids and logits, in the same order, as one
    process's top-k over the whole vocabulary, ties to the lowest id, whatever the split."""
    logits = tied_logits((3, 5, 37), seed=ranks + k)
    parts = [local_top(local, shard, k) for local, shard in shards(logits, ranks, pad=3)]
    ids, values = merge_top(torch.stack([i for i, _ in parts]), torch.stack([v for _, v in parts]), k)
    want_values, want_ids = lowest_id_topk(logits, k)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    assert torch.equal(ids, local_top(logits, VocabShard(0, 37), k)[0])  # one process: the shard of everything


def merged(logits: torch.Tensor, ranks: int, k: int, pad: int = 3):
    parts = [local_candidates(local, shard, k) for local, shard in shards(logits, ranks, pad)]
    ids, values, lse = (torch.stack(t) for t in zip(*parts))
    return merge_candidates(ids, values, lse, k)


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("vocab", [37, 96])
def test_merge_equals_the_full_vocabulary(ranks, k, vocab):
    g = torch.Generator().manual_seed(ranks * 100 + k + vocab)
    logits = torch.randn(3, 5, vocab, generator=g) * 3
    tokens, logp = merged(logits, ranks, k)
    want_tokens, want_logp = draft_topk(logits, k)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    if k == 1:
        assert torch.equal(tokens[..., 0], logits.argmax(-1))


def test_argmax_ties_go_to_the_lowest_id_across_shards():
    logits = torch.zeros(1, 1, 10)
    logits[0, 0, [3, 7]] = 5.0  # the same maximum on rank 0 and rank 1
    tokens, _ = merged(logits, ranks=2, k=1)
    assert tokens.item() == 3 == logits.argmax(-1).item()


def test_shards_past_the_draft_vocabulary_are_never_proposed():
    """A rank whose rows all lie past the draft's vocabulary (size 0) only contributes -inf."""
    logits = torch.randn(2, 3, 8)
    parts = [local_candidates(logits, VocabShard(0, 8), 2), local_candidates(torch.randn(2, 3, 8), VocabShard(8, 0), 2)]
    ids, values, lse = (torch.stack(t) for t in zip(*parts))
    tokens, logp = merge_candidates(ids, values, lse, 2)
    want_tokens, want_logp = draft_topk(logits, 2)
    assert torch.equal(tokens, want_tokens) and (tokens < 8).all()
    torch.testing.assert_close(logp, want_logp)


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3])
def test_merge_with_a_token_map(ranks, k):
    """A reduced draft vocabulary: each rank's rows are the map's ids inside its range; merged, the proposals equal the
    single-process token-map proposals (ids mapped back to target ids)."""
    vocab, g = 40, torch.Generator().manual_seed(ranks + 10 * k)
    token_map = torch.randperm(vocab, generator=g)[:17].sort().values
    logits = torch.randn(2, 4, token_map.numel(), generator=g)  # over the map's ids
    per = -(-vocab // ranks)
    parts = []
    for r in range(ranks):
        inside = (token_map >= r * per) & (token_map < (r + 1) * per)
        shard = VocabShard(r * per, int(inside.sum()), token_map[inside])
        parts.append(local_candidates(logits[..., inside], shard, k))
    ids, values, lse = (torch.stack(t) for t in zip(*parts))
    tokens, logp = merge_candidates(ids, values, lse, k)
    want_tokens, want_logp = draft_topk(logits, k, token_map)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
