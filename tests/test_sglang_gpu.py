"""DFLASH on a real SGLang Engine on CUDA (FlashInfer target attention, overlap scheduler, CUDA graphs for
the target verify). Skipped without a GPU; on a GPU machine sglang must be installed with its CUDA deps
(plain `pip install sglang==0.5.17`), not by .ci/install_sglang.sh.

Same tiny pair and greedy prompts as tests/test_sglang_e2e.py, bf16, for the chain, for tree verification
(`--speculative-eagle-topk 3`, 10 nodes) with the tree mask passed as SGLang's TARGET_VERIFY `custom_mask` to
FlashInfer and to Triton (eager), and to FlashInfer under verify CUDA graphs captured with the mask buffers
(`DFLASH_TREE_CUDA_GRAPH=1`, not yet run on a GPU), and for adaptive shapes (the e2e test's table: verify widths below the captured
CUDA-graph width run eagerly). Speculative and plain bf16 decoding are not bit-identical in general (different
kernels and batch shapes for the same tokens), so this checks that nearly all requests match exactly and that
every request agrees on its first tokens.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from test_sglang_e2e import GREEDY_NEW, TREE_NODES, TREE_TOPK, adaptive_env, greedy_prompts, run_children, write_pair

# job name -> (speculative, attention backend, extra job fields)
ENGINES = {
    "chain": (True, "flashinfer", {}),
    "tree": (True, "flashinfer", {"block": TREE_NODES, "topk": TREE_TOPK}),
    "tree_triton": (True, "triton", {"block": TREE_NODES, "topk": TREE_TOPK}),
    # opt-in: verify CUDA graphs captured with the custom-mask buffers, so tree verifies replay graphs
    "tree_graph": (True, "flashinfer",
                   {"block": TREE_NODES, "topk": TREE_TOPK, "env": {"DFLASH_TREE_CUDA_GRAPH": "1"}}),
    "adaptive": (True, "flashinfer", {}),  # env: adaptive_env (set in the fixture, it needs the pair's dir)
    "plain": (False, "flashinfer", {}),
}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory) -> dict[str, dict]:
    # head_dim 64: FlashInfer's prefill kernels do not compile for the CPU tests' head_dim 8
    root = write_pair(tmp_path_factory.mktemp("dflash_gpu"), "llama", hidden=256)
    jobs = [
        dict(name=name, root=str(root), spec=spec, full=False, device="cuda", dtype="bfloat16",
             attention_backend=backend, out=str(Path(root) / f"{name}.json"),
             engine_kwargs={"cuda_graph_max_bs_decode": 48}, **extra)  # 40 greedy requests; fewer graphs to capture
        for name, (spec, backend, extra) in ENGINES.items()
    ]
    jobs[list(ENGINES).index("adaptive")]["env"] = adaptive_env(root)
    return run_children(jobs, shims=False)


@pytest.mark.parametrize("mode", [name for name, (spec, _, _) in ENGINES.items() if spec])
def test_greedy_close_to_plain_engine_on_gpu(gpu_runs, mode):
    spec = [r["ids"] for r in gpu_runs[mode]["greedy"]]
    plain = [r["ids"] for r in gpu_runs["plain"]["greedy"]]
    assert len(spec) == len(greedy_prompts())
    assert all(len(s) == GREEDY_NEW for s in spec)
    same = sum(s == p for s, p in zip(spec, plain))
    assert same >= 0.9 * len(spec), same
    assert all(s[:4] == p[:4] for s, p in zip(spec, plain))
    # (adaptive: mostly 2-token chains at 40 running requests, see test_sglang_e2e.ADAPTIVE_TABLE)
    best = max(r["meta"]["spec_accept_length"] for r in gpu_runs[mode]["greedy"])
    assert best >= (1.5 if mode == "adaptive" else 2)
