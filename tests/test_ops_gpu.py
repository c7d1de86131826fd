"""CUDA kernels == core/ references bit for bit, eagerly and under CUDA-graph capture + replay.

The references run on CPU copies of the inputs: sample_from's semantics are those of torch's CPU cumsum
(sequential, double accumulator), which the kernel reproduces; torch's CUDA cumsum is a different scan.
"""
import math

import pytest
import torch

from dflash_sglang import ops
from dflash_sglang.core.step import block as ref_block
from dflash_sglang.core.step import tree as ref_tree
from dflash_sglang.core.step import tree_verify as ref_verify
from dflash_sglang.ops.tree import _RESULT_FIELDS, _TREE_FIELDS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def assert_same(got, want, fields):
    for f in fields:
        a, b = getattr(got, f), getattr(want, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), f


def tree_inputs(bs, depth, k, vocab, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(bs, depth, vocab, generator=g) * 2, -1)
    val, idx = logp.topk(k, dim=-1)
    if ties:  # exact score ties and -inf log-probs exercise the tie-break
        val = -torch.randint(0, 3, val.shape, generator=g).float() / 2
        val[:, -1, -1] = float("-inf")
    return torch.randint(0, vocab, (bs,), generator=g), idx, val


def peaked_targets(tree, vocab, g):
    """Target rows with ~3/4 of the mass on the node's children: long sampled paths and rejections both happen."""
    bs, n = tree.tokens.shape
    logits = torch.randn(bs, n, vocab, generator=g)
    kids = tree.parent[:, None, :] == torch.arange(n)[None, :, None]  # [bs, i, j]
    boost = torch.zeros(bs, n, vocab).scatter_add_(2, tree.tokens[:, None, :].expand(bs, n, n),
                                                   kids.float() * math.log(vocab))
    probs = torch.softmax(logits + boost, -1)
    return probs, probs.argmax(-1)


@pytest.mark.parametrize("bs, block", [(1, 2), (99, 7), (256, 16)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_tree_inputs_match_reference(bs, block, index_dtype):
    g = torch.Generator().manual_seed(bs)
    table = torch.randint(0, 1 << 30, (300, 64), generator=g, dtype=torch.int32)
    seq = torch.randint(0, 64 - block, (bs,), generator=g).to(index_dtype)
    pool = torch.randperm(300, generator=g)[:bs].to(index_dtype)
    tokens = torch.randint(0, 1000, (bs, block), generator=g)
    depth = torch.randint(0, block, (bs, block), generator=g).to(index_dtype)
    want = ref_block.build_tree_inputs(tokens, depth, seq, table, pool)
    got = ops.build_tree_inputs(tokens.to(DEV), depth.to(DEV), seq.to(DEV), table.to(DEV), pool.to(DEV))
    assert_same(got, want, ("input_ids", "positions", "out_cache_loc"))
    assert ops.build_tree_inputs(tokens.to(DEV), depth.to(DEV), seq.to(DEV)).out_cache_loc is None


@pytest.mark.parametrize("bs, depth, k, n, ties", [
    (1, 1, 1, 2, False), (99, 7, 3, 19, False), (64, 15, 1, 16, False), (33, 15, 8, 256, False),
    (99, 4, 3, 37, True), (8, 3, 16, 200, True),
])
def test_build_tree_matches_reference(bs, depth, k, n, ties):
    root, idx, val = tree_inputs(bs, depth, k, 5000, seed=n, ties=ties)
    want = ref_tree.build_tree(root, idx, val, n)
    got = ops.build_tree(root.to(DEV), idx.to(DEV), val.to(DEV), n)
    assert_same(got, want, _TREE_FIELDS)
    assert got.max_depth == want.max_depth


@pytest.mark.parametrize("bs, depth, k, n", [(1, 15, 1, 16), (99, 5, 3, 19), (256, 7, 4, 64)])
def test_verify_greedy_matches_reference(bs, depth, k, n):
    g = torch.Generator().manual_seed(n)
    tree = ref_tree.build_tree(*tree_inputs(bs, depth, k, 111, seed=n), n)
    _, argmax = peaked_targets(tree, 111, g)
    loc = torch.randperm(1 << 20, generator=g)[: bs * n].view(bs, n)
    want = ref_verify.verify_tree_greedy(tree, argmax, loc)
    dev_tree = _to(tree, DEV)
    assert_same(ops.verify_tree_greedy(dev_tree, argmax.to(DEV), loc.to(DEV)), want, _RESULT_FIELDS)
    got = ops.verify_tree_greedy(dev_tree, argmax.int().to(DEV), loc.int().to(DEV))
    assert_same(got, want, _RESULT_FIELDS)
    assert int(want.accept_len.max()) >= 2  # peaked targets: real paths get verified


@pytest.mark.parametrize("bs, depth, k, n, vocab", [
    (1, 15, 1, 16, 111), (99, 5, 3, 19, 111), (64, 7, 4, 48, 5000), (8, 3, 4, 21, 151936),
])
@pytest.mark.parametrize("sequential", [False, True])
def test_verify_sampling_matches_reference(bs, depth, k, n, vocab, sequential):
    g = torch.Generator().manual_seed(vocab + n)
    tree = ref_tree.build_tree(*tree_inputs(bs, depth, k, vocab, seed=n), n)
    probs, _ = peaked_targets(tree, vocab, g)
    loc = torch.randperm(1 << 20, generator=g)[: bs * n].view(bs, n)
    for _ in range(3):
        coins, u = torch.rand(bs, n, generator=g), torch.rand(bs, generator=g)
        want = ref_verify.verify_tree_sampling(tree, probs, coins, u, loc)
        got = ops.verify_tree_sampling(_to(tree, DEV), probs.to(DEV), coins.to(DEV), u.to(DEV), loc.to(DEV),
                                       sequential_sampler=sequential)
        assert_same(got, want, _RESULT_FIELDS)


@pytest.mark.parametrize("bs", [1, 33, 256])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["whole", "window", "ring"])
def test_draft_kv_indices_match_reference(bs, index_dtype, layout):
    """The whole context, or a draft window's last W positions (seq_lens given) over the slot rows or its ring."""
    g = torch.Generator().manual_seed(bs)
    table = torch.randint(0, 1 << 30, (300, 2048), generator=g, dtype=torch.int32)
    window, ring = (None, 0) if layout == "whole" else (300, 315 if layout == "ring" else 0)
    seq = torch.randint(0, 2048, (bs,), generator=g)
    keys = seq if window is None else seq.clamp(max=window)
    pool = torch.randperm(300, generator=g)[:bs].to(index_dtype)
    kv = torch.zeros(bs + 1, dtype=torch.int32)
    kv[1:] = torch.cumsum(keys + 16, 0)
    lens, table = (None if window is None else seq.to(index_dtype)), (None if ring else table)
    want = ref_block.draft_kv_indices(kv, pool, table, 7000, 16, torch.full((int(kv[-1]) + 9,), -7, dtype=torch.int32),
                                      seq_lens=lens, ring=ring)
    got = ops.draft_kv_indices(kv.to(DEV), pool.to(DEV), None if table is None else table.to(DEV), 7000, 16,
                               out=torch.full((want.numel(),), -7, dtype=torch.int32, device=DEV),
                               seq_lens=None if lens is None else lens.to(DEV), ring=ring)
    assert torch.equal(got.cpu(), want)


def test_all_ops_under_cuda_graph_capture_and_replay():
    bs, depth, k, n, vocab, block = 32, 7, 4, 32, 3000, 8
    g = torch.Generator().manual_seed(0)

    def fresh():
        root, idx, val = tree_inputs(bs, depth, k, vocab, seed=int(torch.randint(0, 1 << 30, (1,), generator=g)))
        tree = ref_tree.build_tree(root, idx, val, n)
        probs, argmax = peaked_targets(tree, vocab, g)
        return dict(root=root, idx=idx, val=val, seq=torch.randint(0, 100, (bs,), generator=g), probs=probs,
                    argmax=argmax, coins=torch.rand(bs, n, generator=g), u=torch.rand(bs, generator=g))

    table = torch.arange(bs * 200, dtype=torch.int32).view(bs, 200)
    pool = torch.arange(bs)
    cpu = fresh()
    inp = {name: t.to(DEV) for name, t in cpu.items()}
    table_d, pool_d = table.to(DEV), pool.to(DEV)

    def step():
        blk = ops.build_block_inputs(inp["root"], inp["seq"], block, 5, table_d, pool_d, out=bufs["block"])
        tree = ops.build_tree(inp["root"], inp["idx"], inp["val"], n, out=bufs["tree"])
        verify_in = ops.build_tree_inputs(tree.tokens, tree.depth, inp["seq"], table_d, pool_d, out=bufs["tree_in"])
        ops.verify_tree_greedy(tree, inp["argmax"], verify_in.out_cache_loc, out=bufs["greedy"])
        ops.verify_tree_sampling(tree, inp["probs"], inp["coins"], inp["u"], verify_in.out_cache_loc,
                                 out=bufs["sampling"])
        return blk

    bufs = dict(block=None, tree=None, tree_in=None, greedy=None, sampling=None)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up allocates the buffers and builds the library outside capture
        bufs["block"] = ops.build_block_inputs(inp["root"], inp["seq"], block, 5, table_d, pool_d)
        bufs["tree"] = ops.build_tree(inp["root"], inp["idx"], inp["val"], n)
        bufs["tree_in"] = ops.build_tree_inputs(bufs["tree"].tokens, bufs["tree"].depth, inp["seq"], table_d, pool_d)
        loc = bufs["tree_in"].out_cache_loc
        bufs["greedy"] = ops.verify_tree_greedy(bufs["tree"], inp["argmax"], loc)
        bufs["sampling"] = ops.verify_tree_sampling(bufs["tree"], inp["probs"], inp["coins"], inp["u"], loc)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):  # new inputs, copied into the captured tensors; replay must track them
        cpu = fresh()
        for name, t in cpu.items():
            inp[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        tree = ref_tree.build_tree(cpu["root"], cpu["idx"], cpu["val"], n)
        assert_same(bufs["tree"], tree, _TREE_FIELDS)
        assert_same(bufs["block"], ref_block.build_block_inputs(cpu["root"], cpu["seq"], block, 5, table, pool),
                    ("input_ids", "positions", "out_cache_loc"))
        loc = ref_block.build_tree_inputs(tree.tokens, tree.depth, cpu["seq"], table, pool).out_cache_loc
        assert_same(bufs["greedy"], ref_verify.verify_tree_greedy(tree, cpu["argmax"], loc), _RESULT_FIELDS)
        want = ref_verify.verify_tree_sampling(tree, cpu["probs"], cpu["coins"], cpu["u"], loc)
        assert_same(bufs["sampling"], want, _RESULT_FIELDS)


def test_kernel_boundary_errors():
    root, idx, val = tree_inputs(2, 3, 2, 50, seed=0)
    with pytest.raises(ValueError, match="at most 256 nodes"):
        ops.build_tree(root.to(DEV), torch.zeros(2, 8, 2, dtype=torch.long, device=DEV),
                       torch.zeros(2, 8, 2, device=DEV), 300)
    with pytest.raises(ValueError, match="topk_logp is on cpu"):
        ops.build_tree(root.to(DEV), idx.to(DEV), val, 5)
    with pytest.raises(ValueError, match="topk_tokens must be torch.int64"):
        ops.build_tree(root.to(DEV), idx.int().to(DEV), val.to(DEV), 5)


def _to(tree: ref_tree.DraftTree, device) -> ref_tree.DraftTree:
    return ref_tree.DraftTree(*(getattr(tree, f).to(device) for f in _TREE_FIELDS), tree.max_depth)
