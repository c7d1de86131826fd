"""DFLASH on a real SGLang Engine on CUDA (FlashInfer target attention, overlap scheduler, CUDA graphs for
the target verify). Skipped without a GPU; on a GPU machine sglang must be installed with its CUDA deps
(plain `pip install sglang==0.5.17`), not by .ci/install_sglang.sh.

Same tiny pair and greedy prompts as tests/test_sglang_e2e.py, bf16. Speculative and plain bf16 decoding
are not bit-identical in general (different kernels and batch shapes for the same tokens), so this checks
that nearly all requests match exactly and that every request agrees on its first tokens.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from test_sglang_e2e import GREEDY_NEW, greedy_prompts, run_children, write_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory) -> dict[str, dict]:
    root = write_pair(tmp_path_factory.mktemp("dflash_gpu"), "llama")
    jobs = []
    for name, spec in (("spec", True), ("plain", False)):
        jobs.append(dict(
            name=name, root=str(root), spec=spec, full=False, device="cuda", dtype="bfloat16",
            attention_backend="flashinfer", out=str(Path(root) / f"{name}.json"),
        ))
    return run_children(jobs, shims=False)


def test_greedy_close_to_plain_engine_on_gpu(gpu_runs):
    spec = [r["ids"] for r in gpu_runs["spec"]["greedy"]]
    plain = [r["ids"] for r in gpu_runs["plain"]["greedy"]]
    assert len(spec) == len(greedy_prompts())
    assert all(len(s) == GREEDY_NEW for s in spec)
    same = sum(s == p for s, p in zip(spec, plain))
    assert same >= 0.9 * len(spec), same
    assert all(s[:4] == p[:4] for s, p in zip(spec, plain))
    assert any(r["meta"]["spec_accept_length"] >= 2 for r in gpu_runs["spec"]["greedy"])
