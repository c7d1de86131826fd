"""build_tree / verify_tree_greedy / verify_tree_sampling: CUDA kernels on CUDA tensors, core/ references on CPU.

Same contracts as core/step/tree.py and core/step/tree_verify.py, plus destination-passing `out=` (a DraftTree or
TreeAcceptResult of preallocated buffers, see the _new_* helpers for shapes): with it, the CUDA path
allocates nothing, never syncs with the host, and can be captured in a CUDA graph. `backend` as in
ops/block.py. The kernels hold one request's tree in shared memory: N <= 256 nodes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.step import tree as ref_tree
from ..core.step import tree_verify as ref_verify
from ..core.step.tree import DraftTree
from ..core.step.tree_verify import TreeAcceptResult
from . import _abi, _lib

MAX_NODES = 256  # cuda/common.cuh kMaxNodes

_TREE_FIELDS = ("tokens", "parent", "depth", "score", "mask", "retrive_index", "retrive_next_token",
                "retrive_next_sibling")
_RESULT_FIELDS = ("accept_len", "out_tokens", "bonus", "accept_nodes", "commit_loc", "free_loc")


def build_tree(
    root: Tensor, topk_tokens: Tensor, topk_logp: Tensor, num_nodes: int, *, out: DraftTree | None = None,
    backend: str = "auto",
) -> DraftTree:
    """Best-first draft tree; arguments as in core/step/tree.py build_tree."""
    bs, depth, k = ref_tree.check_tree_args(root, topk_tokens, topk_logp, num_nodes)
    if out is not None and out.max_depth != depth:
        raise ValueError(f"out.max_depth must be {depth}, got {out.max_depth}")
    backend = _lib.resolve_backend(backend, root.device)
    if backend == "reference":
        return _copy_into(out, ref_tree.build_tree(root, topk_tokens, topk_logp, num_nodes), _TREE_FIELDS)
    device = root.device
    _check_kernel_nodes(num_nodes)
    _abi.check_inputs(device, root=(root, _abi.INDEX_DTYPES), topk_tokens=(topk_tokens, (torch.int64,)),
                      topk_logp=(topk_logp, (torch.float32,)))
    out = _new_tree(bs, num_nodes, depth, device) if out is None else out
    _check_like(out, _new_tree(bs, num_nodes, depth, "meta"), _TREE_FIELDS, device)
    params = _abi.BuildTreeParams(
        root=_abi.index_view(root), topk_tokens=_abi.ptr(topk_tokens), topk_logp=_abi.ptr(topk_logp),
        bs=bs, depth=depth, k=k, n=num_nodes, tokens=_abi.ptr(out.tokens), parent=_abi.ptr(out.parent),
        node_depth=_abi.ptr(out.depth), score=_abi.ptr(out.score), mask=_abi.ptr(out.mask),
        retrive_index=_abi.ptr(out.retrive_index), retrive_next_token=_abi.ptr(out.retrive_next_token),
        retrive_next_sibling=_abi.ptr(out.retrive_next_sibling),
    )
    _lib.launch(backend, "build_tree", params, device)
    return out


def verify_tree_greedy(
    tree: DraftTree, target_argmax: Tensor, out_cache_loc: Tensor | None = None, *,
    out: TreeAcceptResult | None = None, backend: str = "auto",
) -> TreeAcceptResult:
    """Greedy tree verification; arguments as in core/step/tree_verify.py verify_tree_greedy."""
    ref_verify.check_verify_args(tree, target_argmax, "target_argmax", out_cache_loc)
    backend = _lib.resolve_backend(backend, tree.tokens.device)
    if backend == "reference":
        return _copy_into(out, ref_verify.verify_tree_greedy(tree, target_argmax, out_cache_loc), _RESULT_FIELDS)
    _abi.check_inputs(tree.tokens.device, target_argmax=(target_argmax, _abi.INDEX_DTYPES))
    return _verify(backend, tree, out_cache_loc, out, target_argmax=_abi.index_view(target_argmax))


def verify_tree_sampling(
    tree: DraftTree, target_probs: Tensor, coins: Tensor, resample_u: Tensor, out_cache_loc: Tensor | None = None,
    *, out: TreeAcceptResult | None = None, backend: str = "auto", sequential_sampler: bool = False,
) -> TreeAcceptResult:
    """Lossless tree speculative sampling; arguments as in core/step/tree_verify.py verify_tree_sampling.

    sequential_sampler: skip the kernel's certified parallel pass and always run the sequential definition of
    sample_from (slow: one pass over the vocabulary per row); for tests of the fallback path.
    """
    ref_verify.check_sampling_args(tree, target_probs, coins, resample_u, out_cache_loc)
    backend = _lib.resolve_backend(backend, tree.tokens.device)
    if backend == "reference":
        result = ref_verify.verify_tree_sampling(tree, target_probs, coins, resample_u, out_cache_loc)
        return _copy_into(out, result, _RESULT_FIELDS)
    vocab = target_probs.shape[2]
    if not 1 <= vocab < 2**31:
        raise ValueError(f"vocab size must be in [1, 2**31), got {vocab}")
    f32 = (torch.float32,)
    _abi.check_inputs(tree.tokens.device, target_probs=(target_probs, f32), coins=(coins, f32),
                      resample_u=(resample_u, f32))
    return _verify(backend, tree, out_cache_loc, out, target_probs=_abi.ptr(target_probs), coins=_abi.ptr(coins),
                   resample_u=_abi.ptr(resample_u), vocab=vocab, sequential_sampler=int(sequential_sampler))


def _verify(backend: str, tree: DraftTree, out_cache_loc: Tensor | None, out: TreeAcceptResult | None,
            **mode) -> TreeAcceptResult:
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    _check_kernel_nodes(n)
    _abi.check_inputs(device, tokens=(tree.tokens, (torch.int64,)), parent=(tree.parent, (torch.int64,)),
                      out_cache_loc=(out_cache_loc, _abi.INDEX_DTYPES))
    with_loc = out_cache_loc is not None
    out = _new_result(bs, n, tree.max_depth, with_loc, device) if out is None else out
    _check_like(out, _new_result(bs, n, tree.max_depth, with_loc, "meta"), _RESULT_FIELDS, device)
    params = _abi.VerifyTreeParams(
        tokens=_abi.ptr(tree.tokens), parent=_abi.ptr(tree.parent), bs=bs, n=n, max_depth=tree.max_depth,
        out_cache_loc=_abi.index_view(out_cache_loc), accept_len=_abi.ptr(out.accept_len),
        accept_nodes=_abi.ptr(out.accept_nodes), out_tokens=_abi.ptr(out.out_tokens), bonus=_abi.ptr(out.bonus),
        commit_loc=_abi.ptr(out.commit_loc), free_loc=_abi.ptr(out.free_loc), **mode,
    )
    _lib.launch(backend, "verify_tree", params, device)
    return out


def _check_kernel_nodes(n: int) -> None:
    if n > MAX_NODES:
        raise ValueError(f"the tree kernels support at most {MAX_NODES} nodes, got N={n}")


def _new_tree(bs: int, n: int, depth: int, device) -> DraftTree:
    i64 = lambda: torch.empty(bs, n, dtype=torch.int64, device=device)  # noqa: E731
    return DraftTree(i64(), i64(), i64(), torch.empty(bs, n, device=device),
                     torch.empty(bs, n, n, dtype=torch.bool, device=device), i64(), i64(), i64(), depth)


def _new_result(bs: int, n: int, depth: int, with_loc: bool, device) -> TreeAcceptResult:
    new = lambda *shape: torch.empty(*shape, dtype=torch.int64, device=device)  # noqa: E731
    return TreeAcceptResult(new(bs), new(bs, depth + 1), new(bs), new(bs, depth + 1),
                            new(bs, depth + 1) if with_loc else None, new(bs, n - 1) if with_loc else None)


def _check_like(out, like, fields: tuple[str, ...], device) -> None:
    """Every buffer of `out` matches the corresponding (meta) tensor of `like`; absent ones stay absent."""
    for name in fields:
        have, want = getattr(out, name), getattr(like, name)
        if (have is None) != (want is None):
            raise ValueError(f"out.{name} must be {'absent' if want is None else 'given'} here")
        if want is not None:
            _abi.check_out(f"out.{name}", have, tuple(want.shape), want.dtype, device)


def _copy_into(out, result, fields: tuple[str, ...]):
    if out is None:
        return result
    _check_like(out, result, fields, getattr(result, fields[0]).device)
    for name in fields:
        if getattr(result, name) is not None:
            getattr(out, name).copy_(getattr(result, name))
    return out
