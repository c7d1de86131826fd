"""The SGLang plugin seam and the startup errors, without starting an Engine.

Importing sglang changes the process it is imported in (it patches transformers, and the import shims
for triton / torchvision / vllm must be on the path before transformers first looks for them), so these
tests run in a child pytest process: the parent's only test, `test_plugin_suite_in_a_child_process`,
runs this file again with DFLASH_SGLANG_TEST_CHILD=1 and the shims first on PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang_support import requires_sglang

SHIMS = str(Path(__file__).resolve().parent / "sglang_shims")


pytestmark = requires_sglang
IN_CHILD = os.environ.get("DFLASH_SGLANG_TEST_CHILD") == "1"
child_only = pytest.mark.skipif(not IN_CHILD, reason="runs in the child process of test_plugin_suite_in_a_child_process")


@pytest.mark.skipif(IN_CHILD, reason="this is the child")
def test_plugin_suite_in_a_child_process(tmp_path):
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "DFLASH_SGLANG_TEST_CHILD": "1",
        "PYTHONPATH": os.pathsep.join([SHIMS, repo, os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path), __file__]
    proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in summary and "skipped" in summary and "failed" not in summary, summary


@pytest.fixture(scope="module")
def plugin():
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dflash_sglang.adapter import plugin as plugin_mod

    plugin_mod.register()
    HookRegistry.apply_hooks()
    return plugin_mod


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from factories import draft_config_for, tiny_drafter, tiny_target, write_draft

    root = tmp_path_factory.mktemp("dflash_plugin")
    target = tiny_target("qwen3", vocab=16, seed=0)
    target.save_pretrained(root / "target", safe_serialization=True)
    write_draft(root / "draft", tiny_drafter(draft_config_for(target, block_size=6)), dtype=torch.float32)
    other = tiny_target("llama", vocab=16, hidden=48, seed=0)  # hidden size 48: does not fit the target
    write_draft(root / "wrong", tiny_drafter(draft_config_for(other)), dtype=torch.float32)
    return root


@child_only
def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("dflash_sglang") == "dflash_sglang.adapter.plugin:register"


@child_only
def test_create_worker_routes_dflash_to_ours_and_back(plugin, monkeypatch):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dflash_sglang.adapter.worker import DFlashWorker

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    assert SpeculativeAlgorithm.from_string("dflash").create_worker(None) is DFlashWorker
    # other algorithms are untouched
    eagle = SpeculativeAlgorithm.EAGLE.create_worker(SimpleNamespace(enable_multi_layer_eagle=False))
    assert eagle.__name__ == "EAGLEWorkerV2"
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    assert SpeculativeAlgorithm.DFLASH.create_worker(None).__name__ == "DFlashWorkerV2"
    monkeypatch.setenv(plugin.IMPL_ENV, "turbo")
    with pytest.raises(ValueError, match="DFLASH_SGLANG_IMPL='turbo': expected one of ours, builtin"):
        SpeculativeAlgorithm.DFLASH.create_worker(None)


@child_only
def test_register_is_idempotent(plugin):
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {t: len(h) for t, h in HookRegistry._hooks.items()}
    plugin.register()
    assert {t: len(h) for t, h in HookRegistry._hooks.items()} == before
    assert before[plugin.CREATE_WORKER] == 1


@child_only
def test_unsupported_sglang_version_fails_at_import(monkeypatch):
    """Importing the entry point module (what SGLang's plugin loader does) fails with one line on another SGLang."""
    import importlib
    import importlib.metadata
    import sys

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.23" if name == "sglang" else real(name))
    for name in [m for m in sys.modules if m == "dflash_sglang.adapter" or m.startswith("dflash_sglang.adapter.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    with pytest.raises(ImportError, match=r"^dflash_sglang\.adapter supports sglang==0\.5\.17 only, found "
                                          r"sglang==0\.5\.23: install sglang==0\.5\.17, or uninstall") as err:
        importlib.import_module("dflash_sglang.adapter.plugin")
    assert type(err.value).__name__ == "UnsupportedSGLangError" and "\n" not in str(err.value)


def _server_args(pair: Path, **kw):
    from sglang.srt.server_args import ServerArgs

    args = dict(
        model_path=str(pair / "target"), device="cpu", attention_backend="torch_native", skip_tokenizer_init=True,
        speculative_algorithm="DFLASH", speculative_draft_model_path=str(pair / "draft"),
    )
    return ServerArgs(**{**args, **kw})


@child_only
def test_server_args_resolution(plugin, pair, monkeypatch):
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    args = _server_args(pair)
    assert args.speculative_num_draft_tokens == 6  # the checkpoint's block size
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    assert args.disable_overlap_schedule  # synchronous spec worker on CPU
    assert args.max_running_requests == 48
    assert _server_args(pair, speculative_num_draft_tokens=4).speculative_num_draft_tokens == 4


@child_only
def test_tree_flags_resolution(plugin, pair, monkeypatch):
    """--speculative-eagle-topk k > 1: N = --speculative-num-draft-tokens tree nodes (default: the block size),
    the drafter block from --speculative-dflash-block-size or the checkpoint (6 here)."""
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    resolved = lambda a: (a.speculative_num_draft_tokens, a.speculative_dflash_block_size,  # noqa: E731
                          a.speculative_eagle_topk, a.speculative_num_steps)
    assert resolved(_server_args(pair, speculative_eagle_topk=3, speculative_num_draft_tokens=10)) == (10, 6, 3, 1)
    assert resolved(_server_args(pair, speculative_eagle_topk=2)) == (6, 6, 2, 1)
    tree = _server_args(pair, speculative_eagle_topk=2, speculative_dflash_block_size=4,
                        speculative_num_draft_tokens=15)
    assert resolved(tree) == (15, 4, 2, 1)  # 15 = every node of a depth-3 binary lattice
    assert resolved(_server_args(pair, speculative_eagle_topk=1)) == (6, 6, 1, 1)  # k = 1 is the chain


@child_only
def test_adaptive_flags_resolution(plugin, pair, monkeypatch):
    """DFLASH_ADAPTIVE=1: the drafter block B as for a tree (checkpoint: 6), N = the largest shape the table can
    pick after the depth-5 cap (or the explicit flag), top-k = the largest row top-k."""
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    monkeypatch.setenv("DFLASH_ADAPTIVE", "1")
    resolved = lambda a: (a.speculative_num_draft_tokens, a.speculative_dflash_block_size,  # noqa: E731
                          a.speculative_eagle_topk, a.speculative_num_steps)
    monkeypatch.setenv("DFLASH_ADAPTIVE_TABLE", "4:10x3,inf:4x1")
    assert resolved(_server_args(pair)) == (10, 6, 3, 1)
    assert resolved(_server_args(pair, speculative_num_draft_tokens=12)) == (12, 6, 3, 1)
    assert resolved(_server_args(pair, speculative_dflash_block_size=3)) == (10, 3, 3, 1)  # 1 + 3 + 9 nodes
    monkeypatch.setenv("DFLASH_ADAPTIVE_TABLE", "8:20x1,inf:3x1")  # a chain row is capped to the block
    assert resolved(_server_args(pair)) == (6, 6, 1, 1)
    monkeypatch.delenv("DFLASH_ADAPTIVE_TABLE")
    assert resolved(_server_args(pair)) == (64, 6, 4, 1)  # the default table's 1:64x4 row


@pytest.mark.parametrize(
    "env, kw, match",
    [
        ({"DFLASH_ADAPTIVE": "2"}, {}, r"^DFLASH_ADAPTIVE='2': expected 1"),
        ({"DFLASH_ADAPTIVE_TABLE": "4:10x3"}, {}, r"^DFLASH_ADAPTIVE_TABLE='4:10x3': .* end with 'inf'"),
        ({"DFLASH_ADAPTIVE_TABLE": "4:10x3,inf:4"}, {}, r"^DFLASH_ADAPTIVE_TABLE='4:10x3,inf:4': cannot parse row"),
        ({"DFLASH_ADAPTIVE_TABLE": "4:10x3,inf:4x1"}, dict(speculative_num_draft_tokens=8),
         r"^DFLASH_ADAPTIVE_TABLE='4:10x3,inf:4x1' has a 10x3 row .* more than --speculative-num-draft-tokens 8"),
        ({"DFLASH_ADAPTIVE_TABLE": "4:10x17,inf:4x1"}, {}, r"^DFLASH_ADAPTIVE_TABLE=.* top-k 17 is larger than"),
        ({"DFLASH_ADAPTIVE_TOKEN_BUDGET": "-3"}, {}, r"^DFLASH_ADAPTIVE_TOKEN_BUDGET='-3': expected a positive"),
        ({"DFLASH_ADAPTIVE_TOKEN_BUDGET": "40"}, {}, r"^DFLASH_ADAPTIVE_TOKEN_BUDGET=40 is below --max-running"),
        ({}, dict(speculative_eagle_topk=2), r"^--speculative-eagle-topk 2: with DFLASH_ADAPTIVE=1 the top-k"),
        ({}, dict(page_size=4), r"^--page-size 4: tree verification \(tree rows in DFLASH_ADAPTIVE_TABLE\)"),
        ({"DFLASH_ADAPTIVE_TABLE": "1:300x4,inf:4x1"}, {},
         r"^DFLASH_ADAPTIVE_TABLE='1:300x4,inf:4x1' \(300 nodes\): the tree kernels verify at most 256 nodes"),
        ({"DFLASH_ADAPTIVE": "0"}, dict(speculative_adaptive=True), r"^--speculative-adaptive: SGLang's adaptive mode "
         r"is EAGLE-only; DFLASH picks its shape per step from the batch size with DFLASH_ADAPTIVE=1"),
    ],
)
@child_only
def test_adaptive_startup_errors_name_the_variable(plugin, pair, monkeypatch, env, kw, match):
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    for name, value in {"DFLASH_ADAPTIVE": "1", **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match) as err:
        _server_args(pair, **kw)
    assert "\n" not in str(err.value)


@child_only
def test_tree_refuses_attention_backends_without_a_tree_mask():
    from dflash_sglang.adapter.args import UnsupportedFlagError, resolve_tree_flags
    from dflash_sglang.core.config import DraftConfig

    cfg = DraftConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=16, mask_token_id=15, block_size=6, num_target_layers=4, target_layer_ids=(1,),
    )
    args = SimpleNamespace(speculative_dflash_block_size=None, speculative_num_draft_tokens=8, page_size=1,
                           attention_backend="flashinfer", prefill_attention_backend=None,
                           decode_attention_backend="fa3")
    with pytest.raises(UnsupportedFlagError, match=r"^--decode-attention-backend fa3: tree verification supports"):
        resolve_tree_flags(args, cfg, 2)
    args.decode_attention_backend = "triton"
    assert resolve_tree_flags(args, cfg, 2).nodes == 8


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(tp_size=2), r"^--tp-size 2: only 1 is supported yet"),
        (dict(pp_size=2), r"^--pp-size 2: only 1 is supported yet"),
        (dict(speculative_num_draft_tokens=1), r"^--speculative-num-draft-tokens 1: the block size must be >= 2"),
        (dict(speculative_draft_window_size=64), r"^--speculative-draft-window-size 64: not supported yet"),
        (dict(speculative_num_draft_tokens=4, speculative_dflash_block_size=5), r"^--speculative-num-draft-tokens 4 and"),
        (dict(speculative_eagle_topk=0), r"^--speculative-eagle-topk 0: must be >= 1"),
        (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=1),
         r"^--speculative-num-draft-tokens 1: a draft tree needs >= 2 nodes"),
        (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=64),
         r"^--speculative-num-draft-tokens 64: a tree of depth 5 \(block size 6\) with --speculative-eagle-topk 2 "
         r"has at most 63 nodes"),
        (dict(speculative_eagle_topk=4, speculative_num_draft_tokens=300),
         r"^--speculative-num-draft-tokens 300: the tree kernels verify at most 256 nodes"),
        (dict(speculative_eagle_topk=17), r"^--speculative-eagle-topk 17: larger than the draft vocabulary \(16"),
        (dict(speculative_eagle_topk=2, speculative_dflash_block_size=1),
         r"^--speculative-dflash-block-size 1: the draft block size must be >= 2"),
        (dict(speculative_eagle_topk=2, page_size=4), r"^--page-size 4: tree verification .* needs page size 1"),
    ],
)
@child_only
def test_unsupported_flags_fail_with_one_line(plugin, pair, monkeypatch, kw, match):
    from dflash_sglang.adapter.args import UnsupportedFlagError

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    with pytest.raises(UnsupportedFlagError, match=match) as err:
        _server_args(pair, **kw)
    assert "\n" not in str(err.value)


@child_only
def test_draft_that_does_not_fit_fails_naming_file_and_field(plugin, pair, monkeypatch):
    from dflash_sglang.core.config import CheckpointError

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    with pytest.raises(CheckpointError, match=r"wrong/config\.json: field 'hidden_size'=48 does not match") as err:
        _server_args(pair, speculative_draft_model_path=str(pair / "wrong"))
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=r"nowhere/config\.json: missing"):
        _server_args(pair, speculative_draft_model_path=str(pair / "nowhere"))
    bad = json.loads((pair / "draft" / "config.json").read_text())
    bad["dflash_config"]["target_layer_ids"] = [1, 99]
    (pair / "bad_ids").mkdir(exist_ok=True)
    (pair / "bad_ids" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"bad_ids/config\.json: field 'dflash_config\.target_layer_ids'"):
        _server_args(pair, speculative_draft_model_path=str(pair / "bad_ids"))
    bad["dflash_config"]["target_layer_ids"] = [3, 1, 2]
    (pair / "bad_ids" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"target_layer_ids' must be strictly increasing"):
        _server_args(pair, speculative_draft_model_path=str(pair / "bad_ids"))


@child_only
def test_verify_graph_mask_policy_hook(plugin, monkeypatch):
    """The applied hook on SGLang's resolve_dflash_verify_mask_policy (what the verify graph capture calls): FlashInfer
    skips the custom mask unless DFLASH_TREE_CUDA_GRAPH=1 with trees on CUDA and our worker serving."""
    import sglang.srt.server_args as sa
    from sglang.srt.speculative import dflash_utils

    class FlashInferAttnBackend:  # the policy keys on the class name
        pass

    backend = FlashInferAttnBackend()
    monkeypatch.setattr(sa, "get_global_server_args", lambda: SimpleNamespace(device="cuda", speculative_eagle_topk=4))
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    monkeypatch.delenv("DFLASH_TREE_CUDA_GRAPH", raising=False)
    assert dflash_utils.resolve_dflash_verify_mask_policy(backend) == ("FlashInferAttnBackend", False)
    monkeypatch.setenv("DFLASH_TREE_CUDA_GRAPH", "1")
    assert dflash_utils.resolve_dflash_verify_mask_policy(backend) == ("FlashInferAttnBackend", True)
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    assert dflash_utils.resolve_dflash_verify_mask_policy(backend) == ("FlashInferAttnBackend", False)


@child_only
def test_hub_draft_id_resolves_to_its_snapshot(plugin, pair, monkeypatch, tmp_path):
    """--speculative-draft-model-path ORG/NAME is fetched (here: found offline in a hub cache laid out like
    huggingface_hub's, under --download-dir) and replaced by the local snapshot before the draft is read."""
    from dflash_sglang.core.config import CheckpointError

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--acme--tiny-dflash"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (snap / f).write_bytes((pair / "draft" / f).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    args = _server_args(pair, speculative_draft_model_path="acme/tiny-dflash", download_dir=str(tmp_path / "hub"))
    assert Path(args.speculative_draft_model_path) == snap and args.speculative_num_draft_tokens == 6
    with pytest.raises(CheckpointError, match=r"^--speculative-draft-model-path acme/missing: not a local directory, "
                                              r"and fetching it as a hub repo failed") as err:
        _server_args(pair, speculative_draft_model_path="acme/missing", download_dir=str(tmp_path / "hub"))
    assert "\n" not in str(err.value)


@child_only
def test_missing_gpu_dependency_on_cuda(plugin, monkeypatch):
    from dflash_sglang.adapter import args as args_mod

    monkeypatch.setattr(args_mod.importlib.util, "find_spec", lambda name: None)
    fake = SimpleNamespace(
        device="cuda", tp_size=1, pp_size=1, dp_size=1, enable_dp_attention=False,
        speculative_draft_window_size=None, speculative_draft_model_path="/some/draft",
    )
    with pytest.raises(ImportError, match=r"^--device cuda: DFLASH needs the GPU-only package flashinfer"):
        args_mod.check_supported_flags(fake)
    with pytest.raises(args_mod.UnsupportedFlagError, match=r"^--device xpu: only cuda and cpu"):
        args_mod.check_supported_flags(SimpleNamespace(**{**vars(fake), "device": "xpu"}))
    # flashinfer present, no nvcc: refused at start-up (the kernels are built when the worker starts)
    monkeypatch.setattr(args_mod.importlib.util, "find_spec", lambda name: object())

    def no_nvcc():
        raise RuntimeError("dflash_sglang CUDA ops need nvcc (set CUDA_HOME or put nvcc on PATH) to build cuda/*.cu")

    monkeypatch.setattr(args_mod, "find_nvcc", no_nvcc)
    with pytest.raises(args_mod.UnsupportedFlagError, match=r"^--device cuda: dflash_sglang CUDA ops need nvcc"):
        args_mod.check_supported_flags(fake)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("disaggregation_mode", "prefill", r"^--disaggregation-mode prefill: the draft KV pool cannot be transferred"),
        ("enable_hierarchical_cache", True, r"^--enable-hierarchical-cache: the draft KV pool cannot be transferred"),
        ("kv_cache_dtype", "fp8_e4m3", r"^--kv-cache-dtype fp8_e4m3: the draft KV pool is kept in the model dtype"),
    ],
)
@child_only
def test_flags_that_would_silently_degrade_are_refused(plugin, field, value, match):
    from dflash_sglang.adapter import args as args_mod

    fake = SimpleNamespace(
        device="cpu", tp_size=1, pp_size=1, dp_size=1, enable_dp_attention=False, speculative_draft_window_size=None,
        speculative_draft_model_path="/some/draft", disaggregation_mode="null", enable_hierarchical_cache=False,
        kv_cache_dtype="auto",
    )
    args_mod.check_supported_flags(fake)  # the defaults pass
    with pytest.raises(args_mod.UnsupportedFlagError, match=match) as err:
        args_mod.check_supported_flags(SimpleNamespace(**{**vars(fake), field: value}))
    assert "\n" not in str(err.value)


@child_only
def test_tree_checks_read_what_sglang_picked(plugin):
    """SGLang 0.5.17 stashes its own choices (e.g. fa3 on Hopper when --attention-backend is unset) until the end of
    ServerArgs resolution; the tree checks read them through its resolved view and say so."""
    from dflash_sglang.adapter import args as args_mod

    def fake(**declared):
        return SimpleNamespace(page_size=None, attention_backend=None, prefill_attention_backend=None,
                               decode_attention_backend=None, _resolved_overrides=[("sglang pass", declared)])

    args_mod.check_tree_serving(fake(attention_backend="flashinfer"), 10, "N", "trees")
    with pytest.raises(args_mod.UnsupportedFlagError,
                       match=r"^--attention-backend fa3: tree verification supports torch_native, flashinfer, triton "
                             r"target attention \(SGLang chose it for this model/GPU; pass --attention-backend"):
        args_mod.check_tree_serving(fake(attention_backend="fa3"), 10, "N", "trees")
    with pytest.raises(args_mod.UnsupportedFlagError, match=r"^--page-size 64: .* needs page size 1 \(SGLang chose it"):
        args_mod.check_tree_serving(fake(attention_backend="flashinfer", page_size=64), 10, "N", "trees")
