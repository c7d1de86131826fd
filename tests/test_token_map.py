"""Reduced draft vocabulary (core/draft/token_map.py): building, the checkpoint file, mapped logits and proposals.

Losslessness with a map (greedy and sampling, chains and trees) is tested with the rest of the reference decoder
in test_reference.py (`pair` and the sampling test take a token map); training with one in test_train.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_sglang.core.draft.checkpoint import load_drafter
from dflash_sglang.core.draft.config import CheckpointError
from dflash_sglang.core.draft.token_map import (TOKEN_MAP_FILE, build_token_map, inverse_map, load_token_map,
                                                restrict_head, save_token_map, to_target_ids, token_counts)
from dflash_sglang.core.shape.adaptive import SpecShape
from dflash_sglang.core.speculate import DraftLogits, draft_topk, propose
from factories import draft_config_for, save_tiny_pair, tiny_drafter, tiny_target, write_draft

VOCAB = 96


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(draft_config_for(tiny_target(vocab=VOCAB), block_size=8))


def test_map_is_the_k_most_frequent_ids_sorted_ties_to_the_lower_id():
    counts = token_counts([torch.tensor([5, 5, 5, 9, 9, 2, 7]), torch.tensor([7, 1])], vocab_size=10)
    assert counts.tolist() == [0, 1, 1, 0, 0, 3, 0, 2, 0, 2]
    assert build_token_map(counts, 3).tolist() == [5, 7, 9]  # 7 and 9 tie at 2: both fit
    assert build_token_map(counts, 2).tolist() == [5, 7]  # the tie goes to the lower id
    assert build_token_map(counts, 10).tolist() == list(range(10))
    for k in (0, 11):
        with pytest.raises(ValueError, match=rf"draft vocabulary size must be in \[1, 10\].*got {k}"):
            build_token_map(counts, k)


def test_inverse_map_marks_tokens_outside_the_map():
    token_map = torch.tensor([1, 4, 6])
    inv = inverse_map(token_map, 8)
    assert inv.tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]
    assert torch.equal(to_target_ids(inv[token_map], token_map), token_map)


def test_mapped_logits_equal_the_full_drafters_on_the_mapped_rows(drafter):
    """Same hidden states, head restricted to the map: the logits are exactly the full head's mapped columns, and
    the chain / tree proposals are the best mapped tokens, as target ids."""
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(VOCAB, drafter.cfg.hidden_size, generator=gen)
    hidden = torch.randn(3, 7, drafter.cfg.hidden_size, generator=gen)
    token_map = torch.randperm(VOCAB, generator=gen)[:20].sort().values
    full = drafter.logits(hidden, lm_head)
    mapped = drafter.logits(hidden, restrict_head(lm_head, token_map))
    assert mapped.shape == (3, 7, 20)
    torch.testing.assert_close(mapped, full[..., token_map], rtol=0, atol=1e-5)
    out = torch.empty(3, 7, 20)
    assert drafter.logits(hidden, restrict_head(lm_head, token_map), out=out) is out  # the CUDA-graph path
    torch.testing.assert_close(out, mapped, rtol=0, atol=0)
    bonus = torch.tensor([3, 4, 5])
    best = token_map[full[..., token_map].argmax(-1)]
    assert torch.equal(propose(bonus, DraftLogits(mapped, token_map), SpecShape(8, 1)).ids[:, 1:], best)
    tokens, logp = draft_topk(mapped, 4, token_map)
    want = full[..., token_map].topk(4, dim=-1)
    assert torch.equal(tokens, token_map[want.indices]) and bool(torch.isin(tokens, token_map).all())
    torch.testing.assert_close(logp, torch.log_softmax(full[..., token_map], -1).gather(-1, want.indices))
    tree = propose(bonus, DraftLogits(mapped, token_map), SpecShape(12, 3)).tree
    assert bool(torch.isin(tree.tokens[:, 1:], token_map).all())


def test_checkpoint_round_trip_and_stale_maps(tmp_path, drafter):
    """save_drafter writes the map next to config.json, load_drafter reads it; a map-less export removes a stale
    map and a map-less checkpoint (every z-lab one) loads with the full vocabulary."""
    token_map = torch.tensor([0, 3, 17, 95])
    drafter.token_map = token_map
    try:
        write_draft(tmp_path, drafter)
    finally:
        drafter.token_map = None
    assert (tmp_path / TOKEN_MAP_FILE).is_file()
    assert torch.equal(load_drafter(tmp_path).token_map, token_map)
    write_draft(tmp_path, drafter)
    assert not (tmp_path / TOKEN_MAP_FILE).exists() and load_drafter(tmp_path).token_map is None


BAD_MAPS = [
    ({"token_map": torch.tensor([1, 2], dtype=torch.int32)}, r"tensor 'token_map' must be int64, got torch.int32"),
    ({"token_map": torch.tensor([[1, 2]])}, r"tensor 'token_map' must be a non-empty 1-D list .* shape \[1, 2\]"),
    ({"token_map": torch.tensor([1, 96])}, r"tensor 'token_map' has ids outside the target vocabulary \[0, 96\)"),
    ({"token_map": torch.tensor([4, 2])}, r"tensor 'token_map' must be strictly increasing"),
    ({"token_map": torch.tensor([2, 2])}, r"tensor 'token_map' must be strictly increasing"),
    ({"token_map": torch.tensor([1]), "extra": torch.tensor([2])}, r"expected exactly one tensor 'token_map'"),
    ({"ids": torch.tensor([1])}, r"expected exactly one tensor 'token_map', found \['ids'\]"),
    (b"not a safetensors file", r"not a readable safetensors file"),
]


@pytest.mark.parametrize("content, error", BAD_MAPS, ids=["int32", "2d", "out-of-range", "unsorted", "duplicate",
                                                            "extra-tensor", "wrong-name", "garbage"])
def test_a_bad_map_file_is_refused_naming_file_and_field(tmp_path, drafter, content, error):
    write_draft(tmp_path, drafter)
    path = tmp_path / TOKEN_MAP_FILE
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        save_file(content, str(path))
    with pytest.raises(CheckpointError, match=rf"token_map.safetensors: {error}"):
        load_drafter(tmp_path)
    with pytest.raises(CheckpointError, match=error):
        load_token_map(tmp_path, VOCAB)


def test_cli_inspects_and_decodes_a_checkpoint_with_a_map(tmp_path, capsys):
    """`inspect` reports K; `generate --check-lossless` decodes with the map (drafts only mapped ids) losslessly."""
    from dflash_sglang.cli import main

    target, draft = save_tiny_pair(tmp_path)
    save_token_map(torch.arange(1, 60, 2), draft)
    assert main(["inspect", str(draft), "--target", str(target)]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab"] == 30
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "a prompt", "--json",
                 "--max-new-tokens", "12", "--block-size", "4", "--check-lossless", "--no-chat-template"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["lossless"] is True and len(record["tokens"]) == 12
