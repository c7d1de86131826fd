"""Custom ops: one Python face per op, the CUDA kernel (cuda/*.cu) on CUDA tensors and the plain-PyTorch
reference in dflash_sglang/core/ on CPU tensors (`backend=` overrides; see _lib.resolve_backend).

Importing this package needs neither CUDA nor nvcc: the kernel library is built on first CUDA use (_lib.py).
Ops: build_tree_inputs, draft_kv_indices (block.py); build_tree, verify_tree_greedy,
verify_tree_sampling (tree.py), the last three also as TREE_KERNELS for core's decode step.
"""
from __future__ import annotations

from dflash_sglang.core.speculate import TreeKernels

from ._lib import find_nvcc, load_kernels
from .block import build_tree_inputs, draft_kv_indices
from .tree import MAX_NODES, build_tree, verify_tree_greedy, verify_tree_sampling

# core's decode step (core/speculate.py) on these ops: CUDA kernels on CUDA tensors, the references on CPU
TREE_KERNELS = TreeKernels(build_tree, verify_tree_greedy, verify_tree_sampling)

__all__ = ["MAX_NODES", "TREE_KERNELS", "build_tree", "build_tree_inputs", "draft_kv_indices",
           "find_nvcc", "load_kernels", "verify_tree_greedy", "verify_tree_sampling"]
