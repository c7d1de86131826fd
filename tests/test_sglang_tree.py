"""Tree mode of the SGLang adapter on small tensors, against brute force: the flattened custom mask (GPU
layout), the CPU tree-mask attention, the accepted-path req_to_token permutation and the result rows.

These modules import sglang only inside functions, so this file runs in the plain pytest process; it still
needs the adapter's version gate to pass (sglang 0.5.17 installed).
"""
from __future__ import annotations

import math

import pytest
import torch
from sglang_support import requires_sglang

from dflash_sglang.core.step.block import build_tree_inputs
from dflash_sglang.core.step.tree import build_tree
from dflash_sglang.core.step.tree_verify import verify_tree_greedy


pytestmark = requires_sglang


def _random_tree(bs: int, depth: int, k: int, nodes: int, vocab: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=g)
    logp, tokens = torch.log_softmax(logits, -1).topk(k, dim=-1)
    root = torch.randint(0, vocab, (bs,), generator=g)
    return build_tree(root, tokens, logp, nodes)


def test_flat_custom_mask_matches_concatenated_rows():
    from dflash_sglang.adapter.step.tree import allow_matrix, flat_custom_mask

    tree = _random_tree(bs=4, depth=3, k=2, nodes=7)
    prefix = torch.tensor([5, 0, 1, 9])
    flat = flat_custom_mask(prefix, tree.mask, int(prefix.sum()))
    n = 7
    expected = []
    for b in range(4):
        for i in range(n):
            for c in range(int(prefix[b]) + n):  # row-major, request by request
                expected.append(c < prefix[b] or bool(tree.mask[b, i, c - int(prefix[b])]))
    assert flat.tolist() == expected
    assert flat.numel() == n * int(prefix.sum()) + 4 * n * n
    for b in range(4):
        assert allow_matrix(int(prefix[b]), tree.mask[b]).shape == (n, int(prefix[b]) + n)


def test_verify_mask_under_masked_verify_graphs():
    """--speculative-dflash-tree-cuda-graph (trees on CUDA): graphs captured with mask buffers need a mask on every
    verify, so a chain passes its causal one, whose flattened rows equal the plain causal verify's visibility."""
    from types import SimpleNamespace

    from dflash_sglang.adapter.step.tree import allow_matrix, flat_custom_mask
    from dflash_sglang.adapter.step.verify import masked_verify_graphs, verify_mask

    tree = _random_tree(bs=2, depth=3, k=2, nodes=5)
    assert verify_mask(tree.mask, 2, 5, False, "cpu") is tree.mask and verify_mask(None, 2, 5, False, "cpu") is None
    chain = verify_mask(None, 2, 5, True, "cpu")
    assert chain.shape == (2, 5, 5) and torch.equal(chain[1], torch.ones(5, 5, dtype=torch.bool).tril())
    prefix = torch.tensor([3, 0])
    flat = flat_custom_mask(prefix, chain, 3)
    causal = torch.cat([torch.ones(5, 3, dtype=torch.bool), torch.ones(5, 5, dtype=torch.bool).tril()], 1)
    assert torch.equal(flat[:40], causal.flatten()) and torch.equal(flat[40:], chain[1].flatten())
    assert torch.equal(flat[:40], allow_matrix(3, chain[0]).flatten())
    def settings(**kw):  # the three fields of DFlashSettings the switch reads
        return SimpleNamespace(**{"device": "cuda", "has_tree_rows": True, "tree_cuda_graph": True, **kw})

    assert masked_verify_graphs(settings())
    assert not masked_verify_graphs(settings(tree_cuda_graph=False))  # opt-in
    assert not masked_verify_graphs(settings(has_tree_rows=False))  # trees only
    assert not masked_verify_graphs(settings(device="cpu"))  # no graphs on CPU


@pytest.mark.parametrize("graphs,hybrid,attention_dp,decode", [
    (None, False, False, True),  # CPU or --disable-cuda-graph: plain decoding's forward, where asked
    (object(), False, False, False),  # the target's graphs are captured for TARGET_VERIFY: a one-row verify replays
    (None, True, False, False),  # a hybrid target's recurrent state is committed per verify row
    (None, False, True, False),  # DP attention: every group runs the same forward mode
])
def test_which_plain_steps_run_sglangs_decode_forward(graphs, hybrid, attention_dp, decode):
    from types import SimpleNamespace

    from dflash_sglang.adapter.step.verify import PLAIN_STEP_ENV, decode_serves_plain_steps

    runner = SimpleNamespace(decode_cuda_graph_runner=graphs)
    assert decode_serves_plain_steps(runner, hybrid, attention_dp, "decode") is decode
    for default in (None, "", "verify"):  # the verify by default (faster on CPU: docs/benchmarks.md)
        assert decode_serves_plain_steps(runner, hybrid, attention_dp, default) is False
    with pytest.raises(ValueError, match=f"{PLAIN_STEP_ENV}='fast'"):
        decode_serves_plain_steps(runner, hybrid, attention_dp, "fast")


def test_tree_attention_matches_brute_force():
    from dflash_sglang.adapter.step.tree import tree_attention

    g = torch.Generator().manual_seed(3)
    bs, n, hq, hk, d, dv, slots_total = 3, 6, 4, 2, 8, 5, 64
    tree = _random_tree(bs=bs, depth=4, k=2, nodes=n, seed=1)
    prefix = [4, 1, 7]
    q = torch.randn(bs * n, hq, d, generator=g, dtype=torch.float64)
    k_cache = torch.randn(slots_total, hk, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(slots_total, hk, dv, generator=g, dtype=torch.float64)
    perm = torch.randperm(slots_total, generator=g)
    kv_slots, used = [], 0
    for p in prefix:
        kv_slots.append(perm[used : used + p + n])
        used += p + n
    scale = 0.37
    out = tree_attention(q, k_cache, v_cache, kv_slots, tree.mask, scale)
    for b in range(bs):
        for i in range(n):
            allowed = list(range(prefix[b])) + [prefix[b] + j for j in range(n) if tree.mask[b, i, j]]
            for h in range(hq):
                kh = h // (hq // hk)  # grouped-query: consecutive query heads share a KV head
                scores = [float(q[b * n + i, h] @ k_cache[kv_slots[b][c], kh]) * scale for c in allowed]
                top = max(scores)
                w = [math.exp(s - top) for s in scores]
                ref = sum(wi * v_cache[kv_slots[b][c], kh] for wi, c in zip(w, allowed)) / sum(w)
                torch.testing.assert_close(out[b * n + i, h], ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_compact_path_slots_matches_brute_force(seed):
    from dflash_sglang.adapter.step.tree import compact_path_slots, fit_rows

    g = torch.Generator().manual_seed(seed)
    bs, n, width = 5, 9, 40
    tree = _random_tree(bs=bs, depth=4, k=3, nodes=n, vocab=5, seed=seed)
    req_to_token = torch.randperm(8 * width, generator=g)[: 8 * width].view(8, width).to(torch.int32)
    req_pool_indices = torch.tensor([6, 0, 3, 7, 2])
    seq_lens = torch.randint(0, width - n, (bs,), generator=g)
    inputs = build_tree_inputs(tree.tokens, tree.depth, seq_lens, req_to_token, req_pool_indices)
    # target choices: often a child's token, so paths of every length occur
    noise = torch.randint(0, 5, (bs, n), generator=g)
    argmax = torch.where(torch.rand(bs, n, generator=g) < 0.7, tree.tokens.roll(-1, 1), noise)
    result = verify_tree_greedy(tree, argmax, inputs.out_cache_loc)
    before = req_to_token.clone()
    compact_path_slots(req_to_token, req_pool_indices, seq_lens, result)

    expected = before.clone()
    for b in range(bs):
        row, s = int(req_pool_indices[b]), int(seq_lens[b])
        path = [int(x) for x in result.accept_nodes[b] if x >= 0]
        order = path + [j for j in range(n) if j not in path]
        expected[row, s : s + n] = torch.stack([before[row, s + j] for j in order])
        assert len(path) == int(result.accept_len[b]) + 1
    assert torch.equal(req_to_token, expected)
    rows = fit_rows(result.out_tokens, n)  # D + 1 = 5 columns padded to the row stride N = max_nodes = 9
    assert rows.shape == (bs, n)
    for b in range(bs):
        a = int(result.accept_len[b])
        assert rows[b, a] == result.bonus[b] and bool((rows[b, a + 1 :] == -1).all())


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_decode_hidden_rows_are_the_predicting_verify_rows(tree):
    """return_hidden_states (adapter/step/hidden.py): per request its committed tokens' predicting verify rows at
    i * N + j (a chain's row j, a tree path's j-th node) for a step of n = 4 rows under a row stride of N = max_nodes
    = 8; the slots past n, which a step never commits, stay zero (never read)."""
    from dflash_sglang.adapter.step.hidden import decode_rows

    bs, n, max_nodes, width = 3, 4, 8, 5
    hidden = torch.randn(bs * n, width, generator=torch.Generator().manual_seed(0))
    accept_nodes = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, -1, -1]]) if tree else None
    out = decode_rows(hidden, accept_nodes, bs, max_nodes)
    assert out.shape == (bs * max_nodes, width)
    for i in range(bs):
        path = [int(x) for x in accept_nodes[i] if x >= 0] if tree else list(range(n))
        for j, row in enumerate(path):
            assert torch.equal(out[i * max_nodes + j], hidden[i * n + row]), (i, j)
        assert not out[i * max_nodes + n:(i + 1) * max_nodes].any()
