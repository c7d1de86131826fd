"""Custom ops: one Python face per op, the CUDA kernel (cuda/*.cu) on CUDA tensors and the plain-PyTorch
reference in dflash_sglang/core/ on CPU tensors (`backend=` overrides; see _lib.resolve_backend).

Importing this package needs neither CUDA nor nvcc: the kernel library is built on first CUDA use (_lib.py).
Ops: build_block_inputs, build_tree_inputs, draft_kv_indices (block.py); build_tree, verify_tree_greedy,
verify_tree_sampling
(tree.py).
"""
from __future__ import annotations

from ._lib import find_nvcc, load_kernels
from .block import build_block_inputs, build_tree_inputs, draft_kv_indices
from .tree import MAX_NODES, build_tree, verify_tree_greedy, verify_tree_sampling

__all__ = ["MAX_NODES", "build_block_inputs", "build_tree", "build_tree_inputs", "draft_kv_indices", "find_nvcc",
           "load_kernels",
           "verify_tree_greedy", "verify_tree_sampling"]
