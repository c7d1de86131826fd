"""DFLASH on a real SGLang Engine on CUDA (FlashInfer target attention, overlap scheduler, CUDA graphs for
the target verify). Skipped without a GPU; on a GPU machine sglang must be installed with its CUDA deps
(plain `pip install sglang==0.5.17` beside torch 2.11, or 0.5.23 beside torch 2.14.1), not by .ci/install_sglang.sh.

Same tiny pair and greedy prompts as tests/test_sglang_e2e.py, bf16, for the chain, for tree verification
(`--speculative-eagle-topk 3`, 10 nodes) with the tree mask passed as SGLang's TARGET_VERIFY `custom_mask` to
FlashInfer and to Triton (eager), and to FlashInfer under verify CUDA graphs captured with the mask buffers
(`--speculative-dflash-tree-cuda-graph`; all ran without error on an H100, 2026-11-23), and for adaptive shapes (the
e2e test's
table: verify widths below the captured CUDA-graph width run eagerly), and for a DFlash2 draft (a pinned chain and
selector trees, `--speculative-dflash-experimental`; not yet run on a GPU). Every DFLASH Engine but the Triton one
replays the draft pass and commit as captured CUDA graphs (adapter/draft/graphs.py, the default where the target
captures graphs); the Triton one runs target and draft eagerly (`--disable-cuda-graph`). Speculative and plain bf16
decoding are not
bit-identical (different kernels and batch shapes for the same tokens): on the H100, 8 or 9 of the 40 requests left
the plain output in every mode, and the CPU Engine in bf16 does the same. So this checks that every request
equals the plain output or first leaves it where the plain Engine's top two tokens nearly tie.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from test_sglang_e2e import (ADAPTIVE, BLOCK, TREE_NODES, TREE_TOPK, assert_close_to_plain_bf16,
                             debug_logging_config, run_children, write_dflash2_draft, write_pair)

# job name -> (speculative, attention backend, extra job fields)
ENGINES = {
    "chain": (True, "flashinfer", {}),
    "tree": (True, "flashinfer", {"block": TREE_NODES, "topk": TREE_TOPK}),
    "tree_triton": (True, "triton", {"block": TREE_NODES, "topk": TREE_TOPK, "flags": {"disable_cuda_graph": True}}),
    # opt-in: verify CUDA graphs captured with the custom-mask buffers, so tree verifies replay graphs
    "tree_graph": (True, "flashinfer",
                   {"block": TREE_NODES, "topk": TREE_TOPK, "flags": {"speculative_dflash_tree_cuda_graph": True}}),
    # the e2e test's table; the draft graphs are captured (no static-buffer mode on CUDA)
    "adaptive": (True, "flashinfer", {"flags": {**ADAPTIVE, "speculative_dflash_draft_graphs": "auto"}}),
    # a DFlash2 draft (tests/test_sglang_e2e.py write_dflash2_draft): its pass, candidates and chain walk captured in
    # the draft graph (a host sync there fails the capture), as a pinned chain and with selector trees grown from the
    # replay's candidates
    "dflash2": (True, "flashinfer", {"block": BLOCK, "dflash2": True,
                                     "flags": {"speculative_dflash_experimental": True}}),
    "dflash2_tree": (True, "flashinfer", {"block": TREE_NODES, "topk": TREE_TOPK, "dflash2": True,
                                          "flags": {"speculative_dflash_experimental": True}}),
    "plain": (False, "flashinfer", {"top2": True}),  # top-2 logprobs: where bf16 may flip a choice
}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


@pytest.fixture(scope="module")
def gpu_root(tmp_path_factory) -> Path:
    # head_dim 64: FlashInfer's prefill kernels do not compile for the CPU tests' head_dim 8
    return write_pair(tmp_path_factory.mktemp("dflash_gpu"), "llama", hidden=256)


@pytest.fixture(scope="module")
def gpu_runs(gpu_root) -> dict[str, dict]:
    root = gpu_root
    dflash2 = str(write_dflash2_draft(root))
    jobs = [
        dict(name=name, root=str(root), spec=spec, full=False, device="cuda", dtype="bfloat16",
             attention_backend=backend, out=str(Path(root) / f"{name}.json"),
             # 40 greedy requests; fewer graphs to capture
             engine_kwargs={"cuda_graph_max_bs_decode": 48, **extra.pop("flags", {})}, **extra)
        for name, (spec, backend, extra) in ((n, (s, b, dict(e))) for n, (s, b, e) in ENGINES.items())
    ]
    for job in jobs:
        if job.pop("dflash2", False):
            job["draft"] = dflash2
    for job in jobs:  # INFO/DEBUG lines of dflash_sglang in every child log (what the draft-graph test reads)
        job["env"] = {"SGLANG_LOGGING_CONFIG_PATH": str(debug_logging_config(root)), **job.get("env", {})}
    return run_children(jobs, shims=False)


def test_draft_graphs_captured_on_gpu(gpu_runs, gpu_root):
    """Where the target captures its graphs, the DFLASH Engines captured the draft pass and commit and replayed
    them (padded batches included; the DFlash2 ones with the selector's candidates and walk in the graph);
    --disable-cuda-graph kept the Triton Engine eager."""
    import re

    logs = {name: (gpu_root / f"{name}.log").read_text() for name, (spec, _, _) in ENGINES.items() if spec}
    for name, log in logs.items():
        if name == "tree_triton":
            assert "the draft pass and commit run eagerly" in log, log[-2000:]
            continue
        assert "and commit as CUDA graphs for batch sizes" in log, log[-2000:]
        if name.startswith("dflash2"):
            assert "draft pass with the DFlash2 selector's candidates and walk (" in log, log[-2000:]
        firsts = re.findall(r"first draft replay of size (\d+) \(batch of (\d+)\)", log)
        assert any(int(bs) < int(size) for size, bs in firsts), (name, firsts)


@pytest.mark.parametrize("mode", [name for name, (spec, _, _) in ENGINES.items() if spec])
def test_greedy_close_to_plain_engine_on_gpu(gpu_runs, mode):
    # (test_sglang_e2e.test_bf16_diverges_from_plain_only_at_near_ties checks the same criterion on the CPU)
    assert_close_to_plain_bf16(gpu_runs[mode]["greedy"], gpu_runs["plain"]["greedy"])
