import os
import shutil

import numpy as np
import pytest
import torch

from dflash_sglang import ops
from dflash_sglang.core.step.accept import greedy_accept, rejection_accept
from dflash_sglang.core.step.tree import DraftTree, build_tree, max_tree_nodes
from dflash_sglang.core.step.tree_verify import verify_tree_greedy, verify_tree_sampling


def random_topk(bs, depth, k, vocab, g, tie_grid=False):
    logp = torch.log_softmax(torch.randn(bs, depth, vocab, generator=g) * 2, -1)
    val, idx = logp.topk(k, dim=-1)
    if tie_grid:  # coarse log-probs force many exact score ties
        val = -torch.randint(0, 3, val.shape, generator=g).float() / 2
    return idx, val


def random_tree(bs=99, depth=5, k=3, vocab=111, n=19, seed=0) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    idx, val = random_topk(bs, depth, k, vocab, g)
    return build_tree(torch.randint(0, vocab, (bs,), generator=g), idx, val, n)


def brute_force_order(tokens, logp, n):
    """All lattice nodes of one request sorted by (score desc, depth asc, rank path asc); the first n-1."""
    depth, k = logp.shape
    nodes = []

    def grow(path, score):
        if len(path) == depth:
            return
        for r in range(k):
            s = np.float32(score) + np.float32(logp[len(path), r])  # float32 adds, as the op does
            nodes.append((-float(s), len(path) + 1, path + (r,), float(s)))
            grow(path + (r,), s)

    grow((), np.float32(0))
    return sorted(nodes)[: n - 1]


@pytest.mark.parametrize("seed, tie_grid", [(0, False), (1, True), (2, True)])
def test_build_tree_is_best_first_with_deterministic_ties(seed, tie_grid):
    g = torch.Generator().manual_seed(seed)
    bs, depth, k, n = 5, 4, 3, 23
    idx, val = random_topk(bs, depth, k, 50, g, tie_grid)
    tree = build_tree(torch.arange(bs), idx, val, n)
    for b in range(bs):
        want = brute_force_order(idx[b], val[b], n)
        paths = [w[2] for w in want]
        assert tree.depth[b, 1:].tolist() == [len(p) for p in paths]
        assert tree.score[b, 1:].tolist() == [w[3] for w in want]
        assert tree.tokens[b, 1:].tolist() == [int(idx[b, len(p) - 1, p[-1]]) for p in paths]
        parents = [0 if len(p) == 1 else 1 + paths.index(p[:-1]) for p in paths]
        assert tree.parent[b, 1:].tolist() == parents  # prefix-closed: every parent was selected earlier


def test_tree_structure_invariants():
    tree = random_tree()
    bs, n = tree.tokens.shape
    ids = torch.arange(n)
    assert (tree.parent[:, 0] == -1).all() and (tree.depth[:, 0] == 0).all()
    assert (tree.parent[:, 1:] < ids[1:]).all() and (tree.parent[:, 1:] >= 0).all()
    assert torch.equal(tree.depth[:, 1:], tree.depth.gather(1, tree.parent[:, 1:]) + 1)
    assert (tree.score[:, 1:] <= tree.score[:, :-1]).all()  # best-first order: scores never increase
    assert torch.equal(tree.retrive_index, torch.arange(bs * n).view(bs, n))
    for b in range(0, bs, 7):
        parent = tree.parent[b].tolist()
        for i in range(n):
            anc, j = {i}, i
            while parent[j] >= 0:
                j = parent[j]
                anc.add(j)
            assert tree.mask[b, i].nonzero().flatten().tolist() == sorted(anc)
            children = [j for j in range(n) if parent[j] == i]
            assert tree.retrive_next_token[b, i] == (children[0] if children else -1)
            siblings = [j for j in range(i + 1, n) if i > 0 and parent[j] == parent[i]]
            assert tree.retrive_next_sibling[b, i] == (siblings[0] if siblings else -1)


def test_chain_is_the_k1_tree():
    root, draft = torch.tensor([4, 5]), torch.tensor([[1, 2, 3], [6, 7, 8]])
    tree = build_tree(root, draft[..., None], torch.full((2, 3, 1), -0.5), 4)
    assert tree.tokens.tolist() == [[4, 1, 2, 3], [5, 6, 7, 8]]
    assert tree.parent.tolist() == [[-1, 0, 1, 2]] * 2 and tree.depth.tolist() == [[0, 1, 2, 3]] * 2
    assert tree.mask[0].tolist() == torch.ones(4, 4).tril().bool().tolist()


@pytest.mark.parametrize(
    "shape, n, match",
    [
        ((2, 3, 2), 16, r"num_nodes must be in \[1, 15\]"),
        ((2, 3, 2), 0, "num_nodes must be in"),
        ((2, 16, 16), 8, r"K\*\*D must be < 2\*\*63"),
    ],
)
def test_build_tree_errors(shape, n, match):
    with pytest.raises(ValueError, match=match):
        build_tree(torch.zeros(shape[0], dtype=torch.long), torch.zeros(shape, dtype=torch.long), torch.zeros(shape), n)


def test_build_tree_rejects_bad_log_probs():
    with pytest.raises(ValueError, match="no NaN, all <= 0"):
        build_tree(torch.zeros(1, dtype=torch.long), torch.zeros(1, 2, 2, dtype=torch.long), torch.ones(1, 2, 2), 3)
    with pytest.raises(ValueError, match=r"root must be \[bs\]=\[1\]"):
        build_tree(torch.zeros(2, dtype=torch.long), torch.zeros(1, 2, 2, dtype=torch.long), torch.zeros(1, 2, 2), 3)
    assert max_tree_nodes(3, 2) == 15


# ---------------------------------------------------------------- verification


def _chain_inputs(bs=99, block=7, vocab=111, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, block, vocab, generator=g) * 3
    argmax = logits.argmax(-1)
    draft = torch.where(torch.rand(bs, block - 1, generator=g) < 0.8, argmax[:, :-1],
                        torch.randint(0, vocab, (bs, block - 1), generator=g))
    tree = build_tree(torch.randint(0, vocab, (bs,), generator=g), draft[..., None],
                      torch.zeros(bs, block - 1, 1), block)
    return tree, draft, logits, g


def _same(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("accept_len", "out_tokens", "bonus"))


def test_k1_tree_verifies_like_the_chain_greedy():
    tree, draft, logits, _ = _chain_inputs()
    target = logits.argmax(-1)
    chain, tr = greedy_accept(draft, target), verify_tree_greedy(tree, target)
    assert _same(chain, tr)
    assert int(chain.accept_len.max()) == draft.shape[1] and int(chain.accept_len.min()) == 0


def test_k1_tree_verifies_like_the_chain_sampling():
    tree, draft, logits, g = _chain_inputs(seed=1)
    p = torch.softmax(logits, -1)
    coins, u = torch.rand(*draft.shape, generator=g), torch.rand(len(draft), generator=g)
    chain = rejection_accept(draft, p, coins, u)
    tr = verify_tree_sampling(tree, p, torch.cat([torch.zeros(len(draft), 1), coins], 1), u)
    assert _same(chain, tr)
    assert int(chain.accept_len.max()) == draft.shape[1] and int(chain.accept_len.min()) == 0


def _greedy_target(tree: DraftTree, g, p_follow=0.8):
    """target_argmax that, at each node with children, usually names one of them (so paths get accepted)."""
    bs, n = tree.tokens.shape
    is_child = tree.parent[:, None, :] == torch.arange(n)[None, :, None]  # [bs, i, j]: j is a child of i
    pick = torch.where(is_child, torch.rand(bs, n, n, generator=g), -1.0).argmax(2)
    follow = is_child.any(2) & (torch.rand(bs, n, generator=g) < p_follow)
    return torch.where(follow, tree.tokens.gather(1, pick), torch.randint(0, 111, (bs, n), generator=g))


def peaked_probs(tree: DraftTree, vocab: int, g) -> torch.Tensor:
    """Target rows putting ~3/4 of the mass on the node's children: long paths and sibling rejections both happen."""
    bs, n = tree.tokens.shape
    kids = (tree.parent[:, None, :] == torch.arange(n)[None, :, None]).float()  # [bs, i, j]: j is a child of i
    boost = torch.zeros(bs, n, vocab).scatter_add_(2, tree.tokens[:, None, :].expand(bs, n, n), kids * np.log(vocab))
    return torch.softmax(torch.randn(bs, n, vocab, generator=g) + boost, -1)


def check_result_invariants(tree: DraftTree, r, loc):
    bs, n = tree.tokens.shape
    width = tree.max_depth + 1
    for b in range(bs):
        a = int(r.accept_len[b])
        path = r.accept_nodes[b].tolist()
        assert path[0] == 0 and all(x == -1 for x in path[a + 1 :]) and all(x > 0 for x in path[1 : a + 1])
        assert all(int(tree.parent[b, path[j]]) == path[j - 1] for j in range(1, a + 1))  # connected root -> leaf
        toks = r.out_tokens[b].tolist()
        assert toks[:a] == [int(tree.tokens[b, x]) for x in path[1 : a + 1]]
        assert toks[a] == int(r.bonus[b]) and all(t == -1 for t in toks[a + 1 :]) and len(toks) == width
        commit, free = r.commit_loc[b].tolist(), r.free_loc[b].tolist()
        assert commit[: a + 1] == [int(loc[b, x]) for x in path[: a + 1]] and set(commit[a + 1 :]) <= {-1}
        kept = set(path[: a + 1])
        assert free == [int(loc[b, x]) for x in range(n) if x not in kept] + [-1] * a


def test_greedy_tree_verify_invariants():
    tree = random_tree(seed=3)
    g = torch.Generator().manual_seed(3)
    target = _greedy_target(tree, g)
    loc = torch.randperm(5000, generator=g)[: tree.tokens.numel()].view(tree.tokens.shape)
    r = verify_tree_greedy(tree, target, loc)
    check_result_invariants(tree, r, loc)
    last = r.accept_nodes.gather(1, r.accept_len[:, None]).squeeze(1)
    assert torch.equal(r.bonus, target.gather(1, last[:, None]).squeeze(1))
    for b in range(tree.tokens.shape[0]):  # deepest: no child of the last node matches the target
        kids = tree.parent[b] == last[b]
        assert not (kids & (tree.tokens[b] == r.bonus[b])).any()
    assert int(r.accept_len.min()) == 0 and int(r.accept_len.max()) >= 3


def test_accept_all_and_accept_none():
    tree = random_tree(bs=11, seed=4)
    bs, n = tree.tokens.shape
    first = tree.retrive_next_token
    follow = torch.where(first >= 0, tree.tokens.gather(1, first.clamp_min(0)), -5)  # always the first child
    leaf_depth = torch.zeros(bs, dtype=torch.long)
    for b in range(bs):
        i = 0
        while first[b, i] >= 0:
            i = int(first[b, i])
        leaf_depth[b] = tree.depth[b, i]
    assert torch.equal(verify_tree_greedy(tree, follow).accept_len, leaf_depth)
    none = verify_tree_greedy(tree, torch.full((bs, n), -5))
    assert (none.accept_len == 0).all() and (none.bonus == -5).all()
    p = torch.softmax(torch.randn(bs, n, 111), -1)
    coins = torch.zeros(bs, n)
    assert torch.equal(verify_tree_sampling(tree, p, coins, torch.rand(bs)).accept_len, leaf_depth)
    p_low = p * 0.5  # mass < 1 at every draft token: coins just below 1 reject everything
    r = verify_tree_sampling(tree, p_low, torch.full((bs, n), 0.99999994), torch.rand(bs))
    assert (r.accept_len == 0).all()


def test_sampling_with_one_hot_targets_is_greedy():
    tree = random_tree(seed=5)
    g = torch.Generator().manual_seed(5)
    target = _greedy_target(tree, g).clamp(0, 110)
    one_hot = torch.nn.functional.one_hot(target, 111).float()
    loc = torch.arange(tree.tokens.numel()).view(tree.tokens.shape)
    rg = verify_tree_greedy(tree, target, loc)
    rs = verify_tree_sampling(tree, one_hot, torch.rand(*target.shape, generator=g), torch.rand(len(target)), loc)
    for f in ("accept_len", "out_tokens", "bonus", "accept_nodes", "commit_loc", "free_loc"):
        assert torch.equal(getattr(rg, f), getattr(rs, f)), f
    check_result_invariants(tree, rs, loc)


def _two_level_tree(bs, p_nodes):
    """Root with children 1 (token 0) and 2 (token 2); node 3 (token 1) under node 1; N = 4, V = 5."""
    idx = torch.tensor([[[0, 2], [1, 3]]]).expand(bs, 2, 2)
    val = torch.tensor([[[-0.1, -0.2], [-0.3, -9.0]]]).expand(bs, 2, 2)
    tree = build_tree(torch.full((bs,), 4), idx, val, 4)
    assert tree.tokens[0].tolist() == [4, 0, 2, 1] and tree.parent[0].tolist() == [-1, 0, 0, 1]
    return tree, p_nodes.expand(bs, 4, 5).contiguous()


def test_tree_sampling_first_token_is_exactly_target_distributed():
    """Integrate the coins of both root children and the resample uniform on a midpoint grid."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 5, generator=g) * 1.5, -1)
    n = 64
    grid = (torch.arange(n) + 0.5) / n
    c1, c2, u = torch.meshgrid(grid, grid, grid, indexing="ij")
    bs = c1.numel()
    tree, target = _two_level_tree(bs, p)
    coins = torch.stack([torch.zeros(bs), c1.flatten(), c2.flatten(), torch.zeros(bs)], 1)
    r = verify_tree_sampling(tree, target, coins, u.flatten())
    freq = torch.bincount(r.out_tokens[:, 0], minlength=5).double() / bs
    torch.testing.assert_close(freq, p[0].double(), atol=2.5 / n, rtol=0)


def test_tree_sampling_is_lossless_chi_square():
    """First two emitted tokens: x ~ p_root, then y ~ p_node(x) when x was an accepted draft (node 1)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 5, generator=g), -1)
    bs = 60000
    tree, target = _two_level_tree(bs, p)
    r = verify_tree_sampling(tree, target, torch.rand(bs, 4, generator=g), torch.rand(bs, generator=g))
    first = r.out_tokens[:, 0]
    second = r.out_tokens[first == 0, 1]  # token 0 is node 1's token: next comes from node 1's distribution
    for got, dist in ((first, p[0]), (second, p[1])):
        want = dist.double() / dist.double().sum() * len(got)
        assert chisquare(torch.bincount(got, minlength=5).double().numpy(), want.numpy()).pvalue > 1e-3


def test_torch_cpu_cumsum_accumulates_sequentially_in_double():
    """sample_from's cumsum semantics, which the CUDA sampler mirrors: if torch changes this, the kernel must too."""
    w = torch.rand(100_003, generator=torch.Generator().manual_seed(0)) ** 8
    want = torch.from_numpy(np.cumsum(w.numpy().astype(np.float64)).astype(np.float32))
    assert torch.equal(w.cumsum(0), want)


def test_verify_errors():
    tree = random_tree(bs=3, seed=6)
    with pytest.raises(ValueError, match=r"target_argmax must be \[bs, N\] with bs=3 N=19"):
        verify_tree_greedy(tree, torch.zeros(3, 18, dtype=torch.long))
    with pytest.raises(ValueError, match=r"coins must be \[3, 19\]"):
        verify_tree_sampling(tree, torch.zeros(3, 19, 7), torch.zeros(3, 18), torch.zeros(3))
    with pytest.raises(ValueError, match=r"out_cache_loc must be \[3, 19\]"):
        verify_tree_greedy(tree, torch.zeros(3, 19, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long))


# ---------------------------------------------------------------- the kernels' C++ logic, built for the CPU

needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ or $CXX")
RESULT_FIELDS = ("accept_len", "out_tokens", "bonus", "accept_nodes", "commit_loc", "free_loc")


def _assert_same(got, want, fields):
    for f in fields:
        a, b = getattr(got, f), getattr(want, f)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), f


@needs_cxx
@pytest.mark.parametrize("bs, depth, k, n, tie_grid",
                         [(99, 5, 3, 19, False), (7, 4, 3, 37, True), (5, 15, 1, 16, False)])
def test_kernel_build_tree_logic_matches_reference(bs, depth, k, n, tie_grid):
    g = torch.Generator().manual_seed(n)
    idx, val = random_topk(bs, depth, k, 111, g, tie_grid)
    root = torch.randint(0, 111, (bs,), generator=g)
    want = build_tree(root, idx, val, n)
    got = ops.build_tree(root, idx, val, n, backend="host")
    _assert_same(got, want, ("tokens", "parent", "depth", "score", "mask", "retrive_index", "retrive_next_token",
                             "retrive_next_sibling"))


@needs_cxx
@pytest.mark.parametrize("vocab", [111, 5000])
def test_kernel_verify_logic_matches_reference(vocab):
    tree = random_tree(bs=99, depth=5, k=3, vocab=vocab, n=19, seed=vocab)
    g = torch.Generator().manual_seed(vocab)
    target = _greedy_target(tree, g)
    loc = torch.randperm(1 << 20, generator=g)[: tree.tokens.numel()].view(tree.tokens.shape)
    want = verify_tree_greedy(tree, target, loc)
    _assert_same(ops.verify_tree_greedy(tree, target.int(), loc.int(), backend="host"), want, RESULT_FIELDS)
    probs = peaked_probs(tree, vocab, g)
    for _ in range(3):
        coins, u = torch.rand(99, 19, generator=g), torch.rand(99, generator=g)
        want = verify_tree_sampling(tree, probs, coins, u, loc)
        _assert_same(ops.verify_tree_sampling(tree, probs, coins, u, loc, backend="host"), want, RESULT_FIELDS)
        assert int(want.accept_len.max()) >= 2


@needs_cxx
def test_kernel_resamples_the_target_when_the_residual_has_no_mass():
    """p = [0.5, 0.5 - 2^-25] over the root's two children: rounding rejects both, the residual is empty."""
    idx, val = torch.tensor([[[0, 1]]]), torch.zeros(1, 1, 2)
    tree = build_tree(torch.tensor([2]), idx, val, 3)
    p = torch.zeros(1, 3, 3)
    p[0, 0, :2] = torch.tensor([0.5, 0.5 - 2**-25])
    coins = torch.tensor([[0.0, 1 - 2**-24, 1 - 2**-24]])
    for u in (0.2, 0.7):
        want = verify_tree_sampling(tree, p, coins, torch.tensor([u]))
        assert want.accept_len.item() == 0 and want.bonus.item() == (0 if u < 0.5 else 1)
        _assert_same(ops.verify_tree_sampling(tree, p, coins, torch.tensor([u]), backend="host"), want, RESULT_FIELDS)
