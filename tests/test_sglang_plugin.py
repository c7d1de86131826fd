"""The SGLang plugin seam and the startup errors, without starting an Engine.

Importing sglang changes the process it is imported in (it patches transformers, and the import shims
for triton / torchvision / vllm must be on the path before transformers first looks for them), so these
tests run in a child pytest process: the parent's only test, `test_plugin_suite_in_a_child_process`,
runs this file again with DFLASH_SGLANG_TEST_CHILD=1 and the shims first on PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points, version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang_support import requires_sglang

SHIMS = str(Path(__file__).resolve().parent / "sglang_shims")


pytestmark = requires_sglang
IN_CHILD = os.environ.get("DFLASH_SGLANG_TEST_CHILD") == "1"
child_only = pytest.mark.skipif(not IN_CHILD,
                                reason="runs in the child process of test_plugin_suite_in_a_child_process")


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

    from dflash_sglang.adapter.boot import plugin as plugin_mod

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
    assert eps.get("dflash_sglang") == "dflash_sglang.adapter.boot.plugin:register"


@child_only
def test_create_worker_routes_dflash_to_ours_and_back(plugin, monkeypatch):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dflash_sglang.adapter.step.worker import DFlashWorker

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
@pytest.mark.parametrize("found", ["0.5.16", "0.5.24", "0.6.0"])
def test_unsupported_sglang_version_fails_at_import(monkeypatch, found):
    """Importing the entry point module (what SGLang's plugin loader does) fails with one line naming the supported
    range on any SGLang outside it (then SGLang logs it and keeps its builtin DFLASH)."""
    import importlib
    import importlib.metadata
    import sys

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: found if name == "sglang" else real(name))
    for name in [m for m in sys.modules if m == "dflash_sglang.adapter" or m.startswith("dflash_sglang.adapter.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    with pytest.raises(ImportError, match=rf"^dflash_sglang\.adapter supports sglang 0\.5\.17 \.\. 0\.5\.23 "
                                          rf"only, found sglang=={found}: install sglang==0\.5\.23, "
                                          rf"or uninstall") as err:
        importlib.import_module("dflash_sglang.adapter.boot.plugin")
    assert type(err.value).__name__ == "UnsupportedSGLangError" and "\n" not in str(err.value)


def _argv(pair: Path, **kw) -> list[str]:
    """Command-line flags of a DFLASH server on the tiny pair, plus `kw` (name=value -> --name value)."""
    args = {**dict(model_path=str(pair / "target"), device="cpu", attention_backend="torch_native",
                   skip_tokenizer_init=True, speculative_algorithm="DFLASH",
                   speculative_draft_model_path=str(pair / "draft")), **kw}
    argv = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def _server_args(pair: Path, **kw):
    """Parsed by SGLang's own parser (ours added to it) and resolved the way this SGLang resolves."""
    from sglang.srt.server_args import prepare_server_args

    from dflash_sglang.adapter.versions import resolve

    return resolve(prepare_server_args(_argv(pair, **kw)))


def _shape(server_args):
    """What the worker reads (the attached settings) and what SGLang sizes from (the declared fields)."""
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import resolved_value

    s = settings_of(server_args)
    declared = tuple(resolved_value(server_args, f) for f in ("speculative_num_draft_tokens",
                                                               "speculative_dflash_block_size",
                                                               "speculative_eagle_topk", "speculative_num_steps"))
    assert declared == (s.max_nodes, s.block_size, s.topk, 1), (declared, s)
    return s.mode, s.max_nodes, s.block_size, s.topk


@child_only
def test_server_args_resolution(plugin, pair, monkeypatch):
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import resolved_value

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    args = _server_args(pair)
    # no shape flag: the controller over chains up to the checkpoint's block and trees over top-2 / top-4
    assert _shape(args) == ("goodput", 6, 6, 4)
    with monkeypatch.context() as env:  # simulated acceptance forces chain outcomes: chains only
        env.setenv("DFLASH_SIMULATE_ACC_RATE", "0.8")
        assert _shape(_server_args(pair)) == ("goodput", 6, 6, 1)
    assert resolved_value(args, "disable_overlap_schedule")  # synchronous spec worker on CPU
    # the controller leaves the batch cap to SGLang (as plain decoding) and bounds each step's verify rows instead;
    # a pinned shape keeps the builtin's 48, and an explicit cap is the operator's (no default budget then)
    assert resolved_value(args, "max_running_requests") is None and settings_of(args).max_running_requests is None
    assert settings_of(args).adaptive_token_budget == 48 * 6
    pinned = _server_args(pair, speculative_num_draft_tokens=4)
    assert resolved_value(pinned, "max_running_requests") == 48 == settings_of(pinned).max_running_requests
    capped = settings_of(_server_args(pair, max_running_requests=256))
    assert (capped.mode, capped.max_running_requests, capped.adaptive_token_budget) == ("goodput", 256, None)
    s = settings_of(args)
    assert (s.draft_attention, s.draft_graphs, s.tree_cuda_graph, s.dummy_draft) == ("torch", "auto", False, False)
    assert s.draft.block_size == 6 and s.draft_dir == str(pair / "draft") and s.device == "cpu"
    assert _shape(_server_args(pair, speculative_num_draft_tokens=4)) == ("chain", 4, 4, 1)
    assert _shape(_server_args(pair, speculative_dflash_block_size=5)) == ("chain", 5, 5, 1)
    torch_native = _server_args(pair, speculative_draft_attention_backend="torch_native")
    assert settings_of(torch_native).draft_attention == "torch"


@child_only
def test_dflash2_draft_is_gated(plugin, pair, monkeypatch, tmp_path):
    """A DFlash2 draft (convolutions and a candidate selector) is served behind --speculative-dflash-experimental until
    a GPU run validates it, at any TP size (its candidates merged over the ranks' vocab shards); refused otherwise,
    naming the file, the flag and the builtin."""
    from factories import DFLASH2_DRAFT, draft_config_for, tiny_drafter, tiny_target, write_draft

    from dflash_sglang.adapter.settings import UnsupportedFlagError
    from dflash_sglang.adapter.settings import settings_of

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    target = tiny_target("qwen3", vocab=16, seed=0)
    write_draft(tmp_path / "dflash2", tiny_drafter(draft_config_for(target, block_size=6, **DFLASH2_DRAFT)),
                dtype=torch.float32)
    draft = str(tmp_path / "dflash2")
    for tp in (1, 2):
        with pytest.raises(UnsupportedFlagError, match=r"dflash2/config.json: a DFlash2 draft .* not yet validated end "
                                                       r"to end on a GPU .* pass --speculative-dflash-experimental"):
            _server_args(pair, speculative_draft_model_path=draft, tp_size=tp)
        args = _server_args(pair, speculative_draft_model_path=draft, speculative_dflash_experimental=True, tp_size=tp)
        assert settings_of(args).draft.dflash2 is not None and settings_of(args).mode == "goodput"


@child_only
def test_simulated_step_cost_feeds_the_goodput_controller_only(plugin, pair, monkeypatch):
    """DFLASH_SIMULATE_STEP_COST (adapter/simulate.py): a goodput server's controller observes the fixed cost; beside a
    pinned shape, or malformed, the server refuses to start, naming the variable."""
    from dflash_sglang.adapter.step.shapes import ShapeSchedule
    from dflash_sglang.adapter.settings import UnsupportedFlagError
    from dflash_sglang.adapter.settings import settings_of

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    monkeypatch.setenv("DFLASH_SIMULATE_STEP_COST", "0.02,0.0005,0.00005,0.002,0.0001,0.0002")
    s = settings_of(_server_args(pair))
    assert s.mode == "goodput" and s.step_cost.theta == (0.02, 0.0005, 0.00005, 0.002, 0.0001, 0.0002)
    assert ShapeSchedule.from_settings(s).step_cost == s.step_cost
    with pytest.raises(UnsupportedFlagError, match=r"^DFLASH_SIMULATE_STEP_COST: .*\(chain mode\)"):
        _server_args(pair, speculative_num_draft_tokens=4)
    monkeypatch.setenv("DFLASH_SIMULATE_STEP_COST", "0.02,fast")
    with pytest.raises(ValueError, match=r"^DFLASH_SIMULATE_STEP_COST: '0.02,fast'"):
        _server_args(pair)
    monkeypatch.delenv("DFLASH_SIMULATE_STEP_COST")
    assert settings_of(_server_args(pair)).step_cost is None

@child_only
def test_settings_survive_the_trip_to_the_scheduler(plugin, pair, monkeypatch):
    """The scheduler process gets the record pickled; the worker reads the same settings there."""
    import pickle

    from dflash_sglang.adapter.settings import settings_of

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    args = _server_args(pair, speculative_adaptive=True, speculative_dflash_adaptive_table="4:10x3,inf:4x1")
    copy = pickle.loads(pickle.dumps(args))
    assert settings_of(copy) == settings_of(args) and settings_of(copy).mode == "adaptive"
    with pytest.raises(RuntimeError, match="not resolved by dflash-sglang's hooks"):
        settings_of(SimpleNamespace())


@child_only
def test_engine_keywords_resolve_like_flags(plugin, pair, monkeypatch):
    """`sgl.Engine(speculative_dflash_...=...)`: the Engine builds its ServerArgs through our class hook, with the same
    result as the same flags on the command line."""
    import sglang.srt.entrypoints.engine as engine

    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import resolve

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    plugin.register()  # the Engine module is loaded now: register() routes its keywords
    kw = dict(model_path=str(pair / "target"), device="cpu", attention_backend="torch_native", skip_tokenizer_init=True,
              speculative_algorithm="DFLASH", speculative_draft_model_path=str(pair / "draft"),
              speculative_adaptive=True, speculative_dflash_adaptive_table="4:10x3,inf:4x1",
              speculative_dflash_adaptive_token_budget=60, speculative_dflash_draft_graphs="static")
    from_engine = settings_of(resolve(engine.Engine.server_args_class(**kw)))
    ours = {k: v for k, v in kw.items() if k.startswith("speculative_")
            and k not in ("speculative_algorithm", "speculative_draft_model_path")}
    from_cli = settings_of(_server_args(pair, **ours))
    assert from_engine == from_cli
    assert (from_engine.adaptive_token_budget, from_engine.draft_graphs) == (60, "static")
    # keywords skip argparse's type and choice checks: resolution checks them
    from dflash_sglang.adapter.settings import UnsupportedFlagError

    with pytest.raises(UnsupportedFlagError, match=r"^--speculative-dflash-draft-graphs sometimes: expected one of "
                                                   r"auto, eager, static"):
        resolve(engine.Engine.server_args_class(**{**kw, "speculative_dflash_draft_graphs": "sometimes"}))


@child_only
def test_help_lists_our_flags(plugin, pair, capsys):
    from sglang.srt.server_args import prepare_server_args

    from dflash_sglang.adapter.boot.flags import PLUGIN_FLAGS

    with pytest.raises(SystemExit):
        prepare_server_args(["--help"])
    out = capsys.readouterr().out
    assert "dflash-sglang DFLASH" in out and all(s.flag in out for s in PLUGIN_FLAGS)
    with pytest.raises(SystemExit):  # SGLang's parser checks our flags' types and choices
        prepare_server_args(_argv(pair, speculative_dflash_draft_graphs="sometimes"))
    assert "argument --speculative-dflash-draft-graphs: invalid choice: 'sometimes'" in capsys.readouterr().err


@child_only
def test_tree_flags_resolution(plugin, pair, monkeypatch):
    """--speculative-eagle-topk k > 1: N = --speculative-num-draft-tokens tree nodes (default: the block size),
    the drafter block from --speculative-dflash-block-size or the checkpoint (6 here)."""
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    assert _shape(_server_args(pair, speculative_eagle_topk=3, speculative_num_draft_tokens=10)) == ("tree", 10, 6, 3)
    assert _shape(_server_args(pair, speculative_eagle_topk=2)) == ("tree", 6, 6, 2)
    tree = _server_args(pair, speculative_eagle_topk=2, speculative_dflash_block_size=4,
                        speculative_num_draft_tokens=15)
    assert _shape(tree) == ("tree", 15, 4, 2)  # 15 = every node of a depth-3 binary lattice
    assert _shape(_server_args(pair, speculative_eagle_topk=1)) == ("chain", 6, 6, 1)  # k = 1 is the chain


@child_only
def test_adaptive_flags_resolution(plugin, pair, monkeypatch):
    """--speculative-adaptive: the drafter block B as for a tree (checkpoint: 6), N = the largest shape the table
    can pick after the depth-5 cap (or the explicit flag), top-k = the largest row top-k. SGLang's own (EAGLE)
    adaptive machinery stays off."""
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import resolved_value
    from dflash_sglang.core.shape.adaptive import DEFAULT_TABLE

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)

    def adaptive(table=None, **kw):
        return _server_args(pair, speculative_adaptive=True, speculative_dflash_adaptive_table=table, **kw)

    args = adaptive("4:10x3,inf:4x1")
    assert _shape(args) == ("adaptive", 10, 6, 3) and resolved_value(args, "speculative_adaptive") is False
    assert settings_of(args).adaptive_table == "4:10x3,inf:4x1"
    assert _shape(adaptive("4:10x3,inf:4x1", speculative_num_draft_tokens=12)) == ("adaptive", 12, 6, 3)
    assert _shape(adaptive("4:10x3,inf:4x1", speculative_dflash_block_size=3)) == ("adaptive", 10, 3, 3)
    assert _shape(adaptive("8:20x1,inf:3x1")) == ("adaptive", 6, 6, 1)  # a chain row is capped to the block
    assert _shape(adaptive(DEFAULT_TABLE)) == ("adaptive", 64, 6, 4)  # the static table's 1:64x4 row
    budget = settings_of(adaptive(DEFAULT_TABLE, speculative_dflash_adaptive_token_budget=100))
    assert budget.adaptive_token_budget == 100 and budget.policy().choose(48).nodes == 2
    # no table: the goodput controller over chains up to the block (or the explicit flag) and trees of as many nodes
    assert _shape(adaptive()) == ("goodput", 6, 6, 4)
    assert _shape(adaptive(speculative_num_draft_tokens=4)) == ("goodput", 4, 6, 4)
    assert _shape(adaptive(speculative_eagle_topk=1)) == ("goodput", 6, 6, 1)  # chains only
    assert _shape(adaptive(speculative_eagle_topk=2)) == ("goodput", 6, 6, 2)
    assert _shape(adaptive(page_size=4)) == ("goodput", 6, 6, 1)  # no trees on this server: chains only
    assert settings_of(adaptive(speculative_dflash_adaptive_token_budget=100)).adaptive_token_budget == 100


TABLE = "--speculative-dflash-adaptive-table"
BUDGET = "--speculative-dflash-adaptive-token-budget"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(speculative_dflash_adaptive_table="4:10x3"), rf"^{TABLE} '4:10x3': .* end with 'inf'"),
        (dict(speculative_dflash_adaptive_table="4:10x3,inf:4"), rf"^{TABLE} '4:10x3,inf:4': cannot parse row"),
        (dict(speculative_dflash_adaptive_table="4:10x3,inf:4x1", speculative_num_draft_tokens=8),
         rf"^{TABLE} '4:10x3,inf:4x1' has a 10x3 row .* more than --speculative-num-draft-tokens 8"),
        (dict(speculative_dflash_adaptive_table="4:10x17,inf:4x1"), rf"^{TABLE} .* top-k 17 is larger than"),
        (dict(speculative_dflash_adaptive_token_budget=-3), rf"^{BUDGET} -3: expected a positive"),
        (dict(speculative_dflash_adaptive_token_budget=40, max_running_requests=48),
         rf"^{BUDGET} 40 is below --max-running-requests 48"),
        (dict(speculative_eagle_topk=0), r"^--speculative-eagle-topk 0: with --speculative-adaptive it is the "
                                         r"controller's largest tree top-k"),
        (dict(speculative_eagle_topk=2, page_size=4),
         r"^--page-size 4: tree verification \(--speculative-eagle-topk with --speculative-adaptive\) needs page"),
        (dict(page_size=4, speculative_dflash_adaptive_table="4:10x3,inf:4x1"),
         rf"^--page-size 4: tree verification \(tree rows in {TABLE}\)"),
        (dict(speculative_num_draft_tokens=9), r"^--speculative-num-draft-tokens 9: with --speculative-adaptive it is "
                                               r"the most verify rows per request, 2 .. the drafter block \(6\)"),
        (dict(speculative_dflash_adaptive_table="1:300x4,inf:4x1"),
         rf"^{TABLE} '1:300x4,inf:4x1' \(300 nodes\): the tree kernels verify at most 256 nodes"),
        (dict(speculative_adaptive_config="/tmp/knobs.json"), r"^--speculative-adaptive-config /tmp/knobs.json: EAGLE"),
        (dict(speculative_adaptive=False, speculative_dflash_adaptive_table="4:10x3,inf:4x1"),
         rf"^{TABLE}: needs --speculative-adaptive"),
        (dict(speculative_adaptive=False, speculative_dflash_adaptive_token_budget=64, speculative_num_draft_tokens=4),
         rf"^{BUDGET}: needs --speculative-adaptive"),  # a pinned shape (no flag at all: the controller takes it)
    ],
)
@child_only
def test_adaptive_startup_errors_name_the_flag(plugin, pair, monkeypatch, kw, match):
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    with pytest.raises(ValueError, match=match) as err:
        _server_args(pair, **{"speculative_adaptive": True, **kw})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["DFLASH_ADAPTIVE", "DFLASH_ADAPTIVE_TABLE", "DFLASH_ADAPTIVE_TOKEN_BUDGET",
                                  "DFLASH_DRAFT_ATTENTION", "DFLASH_DRAFT_CUDA_GRAPH", "DFLASH_TREE_CUDA_GRAPH"])
@child_only
def test_retired_environment_variables_are_refused_naming_the_flag(plugin, pair, monkeypatch, name):
    from dflash_sglang.adapter.boot.flags import RETIRED_ENV

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=rf"^{name}='1': this variable is no longer read; use the server flag "
                                         rf"{RETIRED_ENV[name].split()[0]}") as err:
        _server_args(pair)
    assert "\n" not in str(err.value)


@child_only
def test_our_flags_are_refused_where_our_worker_does_not_serve(plugin, pair, monkeypatch):
    """A --speculative-dflash-* flag with another algorithm, or with the builtin, would be ignored: refused."""
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    with pytest.raises(ValueError, match=r"^--speculative-dflash-tree-cuda-graph: a dflash-sglang flag, which only "
                                         r".*\(here DFLASH, DFLASH_SGLANG_IMPL=builtin\)"):
        _server_args(pair, speculative_dflash_tree_cuda_graph=True)
    monkeypatch.delenv(plugin.IMPL_ENV)
    with pytest.raises(ValueError, match=r"^--speculative-dflash-adaptive-table: a dflash-sglang flag, .*here EAGLE"):
        _server_args(pair, speculative_algorithm="EAGLE", speculative_dflash_adaptive_table="inf:4x1")


@child_only
def test_mixed_chunk_is_turned_off_with_a_log_line(plugin, pair, monkeypatch, capfd):
    from dflash_sglang.adapter.versions import resolved_value

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    args = _server_args(pair, enable_mixed_chunk=True)  # (SGLang's parser sets up logging to stderr)
    assert resolved_value(args, "enable_mixed_chunk") is False
    assert "DFLASH (dflash-sglang): --enable-mixed-chunk is turned off" in capfd.readouterr().err


@child_only
def test_tree_refuses_attention_backends_without_a_tree_mask(plugin, monkeypatch):
    """Trees need a target attention backend that takes the tree mask, and full attention in every target layer (a
    sliding window over tree rows, which sit at depths rather than consecutive positions, would be wrong)."""
    from dflash_sglang.adapter.boot import mode
    from dflash_sglang.adapter.settings import UnsupportedFlagError
    from dflash_sglang.adapter.boot.mode import check_tree_serving

    target = {"layer_types": ["full_attention"] * 4}
    monkeypatch.setattr(mode, "model_config", lambda server_args: SimpleNamespace(hf_config=target))
    args = SimpleNamespace(page_size=1, attention_backend="flashinfer", prefill_attention_backend=None,
                           decode_attention_backend="fa3", model_path="m")
    with pytest.raises(UnsupportedFlagError, match=r"^--decode-attention-backend fa3: tree verification supports"):
        check_tree_serving(args, 8, "N", "trees")
    args.decode_attention_backend = "triton"
    check_tree_serving(args, 8, "N", "trees")
    target["layer_types"] = ["sliding_attention", "full_attention"] * 2  # (Gemma 4, gpt-oss)
    with pytest.raises(UnsupportedFlagError, match=r"^--model-path m: tree verification \(trees\) needs full "
                                                   r"attention in every target layer; the target has sliding-window"):
        check_tree_serving(args, 8, "N", "trees")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(speculative_num_draft_tokens=1), r"^--speculative-num-draft-tokens 1: the block size must be >= 2"),
        (dict(speculative_num_draft_tokens=5000), r"^--speculative-num-draft-tokens 5000: at most 256 verify tokens"),
        # a draft window (adapter/draft/context_rows.py): W >= the block (6 here, SGLang's rule), with the radix cache
        # on or off (test_draft_window_resolution)
        *[(dict(speculative_draft_window_size=4, **radix),
           r"^--speculative-draft-window-size 4: must be an integer >= the draft block size \(6\)")
          for radix in ({}, {"disable_radix_cache": True})],
        (dict(speculative_num_draft_tokens=4, speculative_dflash_block_size=5),
         r"^--speculative-num-draft-tokens 4 and"),
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
        (dict(speculative_draft_attention_backend="triton"), r"^--speculative-draft-attention-backend triton: the "
         r"drafter attends with flashinfer \(CUDA\) or torch_native"),
        (dict(speculative_draft_attention_backend="flashinfer"), r"^--speculative-draft-attention-backend flashinfer: "
         r"needs a CUDA device"),

    ],
)
@child_only
def test_unsupported_flags_fail_with_one_line(plugin, pair, monkeypatch, kw, match):
    from dflash_sglang.adapter.settings import UnsupportedFlagError

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    with pytest.raises(UnsupportedFlagError, match=match) as err:
        _server_args(pair, **kw)
    assert "\n" not in str(err.value)


@child_only
def test_draft_that_does_not_fit_fails_naming_file_and_field(plugin, pair, monkeypatch):
    from dflash_sglang.core.draft.config import CheckpointError

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
def test_weight_errors_surface_at_startup(plugin, pair, monkeypatch):
    """A weight-level checkpoint error (here: one tensor missing) fails ServerArgs resolution with one line, before
    any scheduler loads the target; a dummy-weight draft needs no weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_sglang.core.draft.config import CheckpointError

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    broken = pair / "missing_tensor"
    shutil.copytree(pair / "draft", broken, dirs_exist_ok=True)
    tensors = load_file(broken / "model.safetensors")
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"missing_tensor/model\.safetensors: .*{dropped}") as err:
        _server_args(pair, speculative_draft_model_path=str(broken))
    assert "\n" not in str(err.value)
    _server_args(pair, speculative_draft_model_path=str(broken), speculative_draft_load_format="dummy")


@child_only
def test_token_map_resolution(plugin, pair, monkeypatch, tmp_path):
    """The checkpoint's own token_map.safetensors is used by default; --speculative-token-map picks another file;
    pickle files and broken maps are refused at start-up naming the flag or file."""
    import shutil

    from dflash_sglang.adapter.settings import UnsupportedFlagError
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.core.draft.config import CheckpointError
    from dflash_sglang.core.draft.token_map import save_token_map

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    assert settings_of(_server_args(pair)).token_map is None  # no map: the full vocabulary
    mapped = tmp_path / "mapped"
    shutil.copytree(pair / "draft", mapped)
    own = save_token_map(torch.tensor([0, 2, 5, 9]), mapped)
    assert settings_of(_server_args(pair, speculative_draft_model_path=str(mapped))).token_map == str(own)
    other = save_token_map(torch.tensor([1, 2, 3]), tmp_path / "other")
    args = _server_args(pair, speculative_draft_model_path=str(mapped), speculative_token_map=str(other))
    assert settings_of(args).token_map == str(other)
    (tmp_path / "map.pt").write_bytes(b"pickle")
    with pytest.raises(UnsupportedFlagError, match=r"^--speculative-token-map .*map\.pt: expected a \.safetensors"):
        _server_args(pair, speculative_token_map=str(tmp_path / "map.pt"))
    with pytest.raises(UnsupportedFlagError, match=r"^--speculative-token-map .*nothing\.safetensors: no such file"):
        _server_args(pair, speculative_token_map=str(tmp_path / "nothing.safetensors"))
    too_big = save_token_map(torch.tensor([1, 99]), tmp_path / "too_big")  # the draft vocabulary is 16
    with pytest.raises(CheckpointError, match=r"too_big/token_map\.safetensors"):
        _server_args(pair, speculative_token_map=str(too_big))


def _hybrid_target(pair: Path, root: Path, architecture: str) -> Path:
    """A target directory with Qwen3-Next's config (gated-delta-net layers), under `architecture`."""
    from transformers import Qwen3NextConfig

    base = json.loads((pair / "target" / "config.json").read_text())
    cfg = Qwen3NextConfig(vocab_size=16, hidden_size=base["hidden_size"], num_hidden_layers=4,
                          num_attention_heads=base["num_attention_heads"],
                          num_key_value_heads=base["num_key_value_heads"],
                          intermediate_size=64, head_dim=base.get("head_dim", 8), num_experts=2, num_experts_per_tok=1)
    cfg.architectures = [architecture]
    if architecture != "Qwen3NextForCausalLM":  # another recurrent family: its own model_type too
        cfg.model_type = "jamba"
    (root / architecture).mkdir()
    cfg.save_pretrained(root / architecture)
    if architecture != "Qwen3NextForCausalLM":
        data = json.loads((root / architecture / "config.json").read_text())
        (root / architecture / "config.json").write_text(json.dumps({**data, "model_type": "qwen3"}))
    return root / architecture


@child_only
def test_hybrid_linear_attention_target_is_gated(plugin, pair, monkeypatch, tmp_path):
    """Qwen3-Next (gated-delta-net layers): served by ours only with --speculative-dflash-experimental (until a GPU
    end-to-end run validates it) and only on CUDA (SGLang's linear-attention kernels); other recurrent families are
    refused whatever the flags, each naming the builtin."""
    from dflash_sglang.adapter.settings import UnsupportedFlagError

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    qwen3_next = str(_hybrid_target(pair, tmp_path, "Qwen3NextForCausalLM"))
    # (without a radix cache: SGLang's own Mamba-cache checks refuse CPU before ours would run)
    with pytest.raises(UnsupportedFlagError, match=r"^--model-path .*: the target has recurrent / linear-attention "
                                                   r"layers \(.*Qwen3Next.*\), not yet validated .* pass "
                                                   r"--speculative-dflash-experimental .* DFLASH_SGLANG_IMPL=builtin$"):
        _server_args(pair, model_path=qwen3_next, disable_radix_cache=True)
    with pytest.raises(UnsupportedFlagError, match=r"^--model-path .*: SGLang's linear-attention kernels run on "
                                                   r"CUDA only, not --device cpu"):
        _server_args(pair, model_path=qwen3_next, disable_radix_cache=True, speculative_dflash_experimental=True)
    jamba = str(_hybrid_target(pair, tmp_path, "JambaForCausalLM"))
    with pytest.raises(UnsupportedFlagError, match=r"architecture JambaForCausalLM\); dflash-sglang serves Gated "
                                                   r"DeltaNet hybrids only .* DFLASH_SGLANG_IMPL=builtin$"):
        _server_args(pair, model_path=jamba, disable_radix_cache=True, speculative_dflash_experimental=True)


@child_only
def test_soft_capped_gemma4_draft_is_gated(plugin, pair, monkeypatch, tmp_path):
    """A Gemma 4-style draft (final_logit_softcapping, sliding-window layers) loads; ours serves it with
    --speculative-dflash-experimental only, and refuses it otherwise naming the field, the flag and the builtin."""
    from dflash_sglang.adapter.settings import UnsupportedFlagError
    from dflash_sglang.adapter.settings import settings_of
    from factories import draft_config_for, tiny_drafter, tiny_target, write_draft

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    target = tiny_target("qwen3", vocab=16, seed=0)
    cfg = draft_config_for(target, block_size=6, layer_types=("sliding_attention", "full_attention"),
                           sliding_window=8, final_logit_softcapping=30.0)
    gemma = write_draft(tmp_path / "gemma_style", tiny_drafter(cfg), dtype=torch.float32)
    with pytest.raises(UnsupportedFlagError, match=r"^.*gemma_style/config.json: field "
                                                   r"'dflash_config.final_logit_softcapping' \(a soft-capped Gemma 4 "
                                                   r"draft\) .* pass --speculative-dflash-experimental .*"
                                                   r"DFLASH_SGLANG_IMPL=builtin$"):
        _server_args(pair, speculative_draft_model_path=str(gemma))
    settings = settings_of(_server_args(pair, speculative_draft_model_path=str(gemma),
                                        speculative_dflash_experimental=True))
    assert settings.draft.final_logit_softcapping == 30.0 and not settings.hybrid


@child_only
def test_verify_graph_mask_policy_hook(plugin, monkeypatch):
    """The applied hook on SGLang's resolve_dflash_verify_mask_policy (what the verify graph capture calls): FlashInfer
    skips the custom mask unless the published settings ask for tree verify graphs (CUDA, trees) and ours serves."""
    from sglang.srt import runtime_context
    from sglang.srt.speculative import dflash_utils

    class FlashInferAttnBackend:  # the policy keys on the class name
        pass

    def publish(**settings):
        settings = SimpleNamespace(**{"device": "cuda", "has_tree_rows": True, "tree_cuda_graph": False, **settings})
        published = SimpleNamespace(server_args=SimpleNamespace(_dflash_settings=settings))
        monkeypatch.setattr(runtime_context, "get_context", lambda: published)

    backend = FlashInferAttnBackend()
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    publish()
    assert dflash_utils.resolve_dflash_verify_mask_policy(backend) == ("FlashInferAttnBackend", False)
    publish(tree_cuda_graph=True)
    assert dflash_utils.resolve_dflash_verify_mask_policy(backend) == ("FlashInferAttnBackend", True)
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    assert dflash_utils.resolve_dflash_verify_mask_policy(backend) == ("FlashInferAttnBackend", False)


@child_only
@pytest.mark.parametrize("output, cap, stop_ids", [
    ([5, 6, 7, 8, 9], 5, [7]),  # a stop token inside a step that reaches the cap: plain stops at it
    ([5, 6, 9, 8, 7], 5, [7]),  # the stop is the cap's own token: as plain decides it on this version
    ([5, 6, 7, 8, 9], 9, [7]),  # no cap in the step
    ([5, 6, 9, 8, 4], 5, [7]),  # no stop: length
])
def test_a_multi_token_commit_finishes_as_one_token_steps_do(plugin, monkeypatch, output, cap, stop_ids):
    """Our worker commits up to N tokens a step; the scheduler's finish check must end the request exactly where
    plain decoding (one token a step) ends it. SGLang 0.5.17 checks max_new_tokens first and kept tokens after a
    stop accepted in the step that reached the cap (found by scripts/stress.py); the seam hooks it."""
    from sglang.srt import runtime_context
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    published = SimpleNamespace(server_args=SimpleNamespace(_dflash_settings=object()))
    monkeypatch.setattr(runtime_context, "get_context", lambda: published)

    def req():
        params = SamplingParams(max_new_tokens=cap, stop_token_ids=stop_ids)
        params.normalize(None)
        r = Req("r", "", [1, 2, 3], params, eos_token_ids={2})
        r.vocab_size = 16  # set by the scheduler
        return r

    plain, spec = req(), req()
    for token in output:  # plain decoding: one token a step
        plain.output_ids.append(token)
        plain.update_finish_state(1)
        if plain.finished():
            break
    spec.output_ids = [5, 6]  # a first step, then one step committing the rest at once
    spec.update_finish_state(2)
    spec.output_ids = list(output)
    spec.update_finish_state(len(output) - 2)
    assert (type(spec.finished_reason), spec.finished_len) == (type(plain.finished_reason), plain.finished_len)


@child_only
def test_commits_stop_at_max_new_tokens_even_for_an_aborted_request(plugin, monkeypatch):
    """SGLang trims a multi-token commit at max_new_tokens when the request ends by length, but an abort marked
    before the step (`to_finish`) ends it first and keeps every committed token (found by scripts/stress.py: an
    aborted stream answered 6 tokens for max 5). Our worker cuts each run at the request's limit itself."""
    import torch

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from dflash_sglang.adapter.step.worker import DFlashWorker, _Accepted
    from dflash_sglang.core.step.accept import greedy_accept

    params = SamplingParams(max_new_tokens=5)
    params.normalize(None)
    aborted = Req("r", "", [1, 2, 3], params, eos_token_ids={2})
    aborted.output_ids = [5, 6]
    aborted.to_finish = object()  # what an abort request sets
    aborted.output_ids += [7, 8, 9, 10]
    aborted.update_finish_state(4)
    assert aborted.finished() and aborted.finished_len is None  # upstream: 6 tokens kept for max 5

    # two requests (prompt 3, max 5 / prompt 4, max 9) with 2 and 1 output tokens: KV lengths 4 and 4
    reqs = [SimpleNamespace(origin_input_ids=[1] * p, sampling_params=SimpleNamespace(max_new_tokens=m))
            for p, m in ((3, 5), (4, 9))]
    batch = SimpleNamespace(reqs=reqs, seq_lens=torch.tensor([4, 4]), seq_lens_cpu=torch.tensor([4, 4]))
    r = greedy_accept(torch.tensor([[7, 8, 9], [7, 8, 9]]), torch.tensor([[7, 8, 9, 10], [7, 8, 9, 10]]))
    step = _Accepted(r.out_tokens, r.accept_len, r.bonus, None, None, None, False)
    worker = object.__new__(DFlashWorker)
    worker.context_len = 64
    cut = worker._within_max_new_tokens(batch, step, 4)
    assert cut.out_tokens.tolist() == [[7, 8, 9, -1], [7, 8, 9, 10]]  # 3 more tokens reach max 5; 9 is far
    assert cut.accept_len.tolist() == [2, 3] and cut.bonus.tolist() == [9, 10]
    assert worker._within_max_new_tokens(batch, step, 3) is step  # no request within 3 tokens: nothing done


@child_only
def test_hub_draft_id_resolves_to_its_snapshot(plugin, pair, monkeypatch, tmp_path):
    """--speculative-draft-model-path ORG/NAME is fetched (here: found offline in a hub cache laid out like
    huggingface_hub's, under --download-dir) and replaced by the local snapshot before the draft is read."""
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import resolved_value
    from dflash_sglang.core.draft.config import CheckpointError

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
    assert Path(resolved_value(args, "speculative_draft_model_path")) == snap == Path(settings_of(args).draft_dir)
    assert settings_of(args).max_nodes == 6
    with pytest.raises(CheckpointError, match=r"^--speculative-draft-model-path acme/missing: not a local directory, "
                                              r"and fetching it as a hub repo failed") as err:
        _server_args(pair, speculative_draft_model_path="acme/missing", download_dir=str(tmp_path / "hub"))
    assert "\n" not in str(err.value)


def _flags(**kw):
    """A read view of server args for check_supported_flags: the defaults, plus kw."""
    return SimpleNamespace(**{
        "device": "cpu", "tp_size": 1, "pp_size": 1, "dp_size": 1, "enable_dp_attention": False,
        "speculative_draft_window_size": None, "speculative_draft_model_path": "/some/draft",
        "disaggregation_mode": "null", "enable_hierarchical_cache": False, "kv_cache_dtype": "auto", **kw})


@child_only
@pytest.mark.parametrize("kv", ["mxfp8", "nvfp4", "fp4_mx_block16"])
def test_block_scaled_kv_is_refused_for_the_draft_pool(plugin, kv):
    """The draft pool follows --kv-cache-dtype when no draft dtype is given; block-scaled and fp4 KV it cannot store.
    (On CPU SGLang refuses these itself first, so the flag view is checked directly.)"""
    from dflash_sglang.adapter.boot import refusals

    with pytest.raises(refusals.UnsupportedFlagError, match=rf"^--kv-cache-dtype {kv}: the draft KV pool stores auto, "
                       r"bf16, bfloat16, fp8_e4m3, fp8_e5m2 \(block-scaled or fp4 KV not yet\)"):
        refusals.check_supported_flags(_flags(kv_cache_dtype=kv))
    refusals.check_supported_flags(_flags(kv_cache_dtype="fp8_e5m2"))  # (fp8: the pool stores it)


@child_only
def test_missing_gpu_dependency_on_cuda(plugin, monkeypatch):
    from dflash_sglang.adapter.boot import refusals

    monkeypatch.setattr(refusals.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"^--device cuda: DFLASH needs the GPU-only package flashinfer"):
        refusals.check_supported_flags(_flags(device="cuda"))
    with pytest.raises(refusals.UnsupportedFlagError, match=r"^--device xpu: only cuda and cpu"):
        refusals.check_supported_flags(_flags(device="xpu"))
    # flashinfer present, no nvcc: refused at start-up (the kernels are built when the worker starts)
    monkeypatch.setattr(refusals.importlib.util, "find_spec", lambda name: object())

    def no_nvcc():
        raise RuntimeError("dflash_sglang CUDA ops need nvcc (set CUDA_HOME or put nvcc on PATH) to build cuda/*.cu")

    monkeypatch.setattr(refusals, "find_nvcc", no_nvcc)
    with pytest.raises(refusals.UnsupportedFlagError, match=r"^--device cuda: dflash_sglang CUDA ops need nvcc"):
        refusals.check_supported_flags(_flags(device="cuda"))


# Without --speculative-dflash-experimental: not validated on a GPU yet (0.5.23), or not served by this release at all
DP_ATTENTION = r"DP attention is not (yet validated end to end on a GPU|served by dflash-sglang on SGLang 0\.5\.)"
HICACHE = (r"(HiCache is not yet validated end to end on a GPU with dflash-sglang: pass "
           r"--speculative-dflash-experimental|SGLang 0\.5\.\d+ gives a DFLASH draft KV pool no HiCache host pool)")
CONTEXT_PARALLEL = r"is not supported \(the drafter reads every context position's draft K/V on each rank\)"


@pytest.mark.parametrize(
    "kw, match",
    [
        # every layout with more than one rank of something, but TP, EP and DP replicas (served): DP attention in both
        # spellings (0.5.23 rewrites --enable-dp-attention --dp N into attn_dp_size=N, dp_size=1 before any other step
        # reads them), PP, attention / decode / prefill context parallelism (MoE DP needs attention CP)
        (dict(tp_size=2, attn_dp_size=2), rf"^--attn-dp-size 2: {DP_ATTENTION}"),
        (dict(tp_size=2, attn_dp_size=2, enable_dp_lm_head=True), rf"^--attn-dp-size 2: {DP_ATTENTION}"),
        (dict(tp_size=2, enable_dp_attention=True, dp_size=2),
         rf"^(--attn-dp-size|--enable-dp-attention --dp-size) 2: {DP_ATTENTION}"),
        (dict(pp_size=2), r"^--pp-size 2: pipeline parallelism is not supported yet"),
        (dict(tp_size=2, attn_cp_size=2), rf"^--attn-cp-size 2: context-parallel attention {CONTEXT_PARALLEL}"),
        (dict(tp_size=2, attn_cp_size=2, moe_dp_size=2), r"^--attn-cp-size 2: context-parallel attention"),
        (dict(tp_size=2, dcp_size=2), rf"^--dcp-size 2: decode context parallelism {CONTEXT_PARALLEL}"),
        (dict(enable_prefill_cp=True, cp_strategy="zigzag"), r"^--enable-prefill-cp: prefill context parallelism is "
         r"not supported"),
        # what would serve with a stale or foreign draft KV pool, or not as asked
        (dict(enable_hierarchical_cache=True), rf"^--enable-hierarchical-cache: {HICACHE}"),
        (dict(enable_unified_cache_external_linker=True), r"^--enable-unified-cache-external-linker: the draft KV pool "
         r"is not registered"),
        (dict(speculative_use_block_verification=True), r"^--speculative-use-block-verification: block verification"),
        (dict(speculative_draft_window_size=64, disable_radix_cache=True, speculative_draft_sink_size=4),
         r"^--speculative-draft-sink-size 4: the draft window keeps no sink rows"),
        # (SGLang itself refuses deterministic inference with torch_native; with triton it reaches our check)
        (dict(attention_backend="triton", enable_deterministic_inference=True),
         r"^--enable-deterministic-inference: seeded \(sampling_seed\)"),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "refused",
)
@child_only
def test_refusals_through_sglangs_own_resolution(plugin, pair, monkeypatch, kw, match):
    """One line each, at start-up, from the flags as a user types them, parsed by SGLang's parser and resolved by its
    own pipeline (0.5.23: resolve_once(), whose parallel steps run before our check; 0.5.17: the constructor). A flag
    this SGLang does not have is skipped by name."""
    from dflash_sglang.adapter.settings import UnsupportedFlagError

    missing = [f for f in _argv(Path("."), **kw) if f.startswith("--") and not _sglang_has_flag(f)]
    if missing:
        pytest.skip(f"sglang {version('sglang')} has no {' '.join(missing)}")
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    with pytest.raises(UnsupportedFlagError, match=match) as err:
        _server_args(pair, **kw)
    assert "\n" not in str(err.value) and "DFLASH_SGLANG_IMPL=builtin" in str(err.value)


DP_LM_HEAD = r"DFLASH under DP attention needs --enable-dp-lm-head"


# What --speculative-dflash-experimental serves where the release has what it needs: feature -> (the probe, the refusal
# naming the release where it has not, what SGLang's resolved args say when served)
EXPERIMENTAL_FEATURES = {
    "dp_attention": ("attention_dp_served", r"DP attention is not served by dflash-sglang on SGLang {v} \(0\.5\.23 has",
                     lambda versions, cfg: versions.attention_dp(cfg) == ("--attn-dp-size", 2)),
    "hicache": ("hicache_draft_served", r"^--enable-hierarchical-cache: SGLang {v} gives a DFLASH draft KV pool no "
                r"HiCache host pool", lambda versions, cfg: cfg.enable_hierarchical_cache is True),
}


@pytest.mark.parametrize("feature, kw, served_match", [
    ("dp_attention", dict(tp_size=2, attn_dp_size=2), rf"^--attn-dp-size 2: {DP_LM_HEAD}"),
    ("dp_attention", dict(tp_size=2, enable_dp_attention=True, dp_size=2),
     rf"^(--attn-dp-size|--enable-dp-attention --dp-size) 2: {DP_LM_HEAD}"),
    ("dp_attention", dict(tp_size=2, attn_dp_size=2, enable_dp_lm_head=True), None),  # served
    ("dp_attention", dict(tp_size=4, attn_dp_size=2, enable_dp_lm_head=True), None),  # two attention-TP ranks per group
    ("hicache", dict(enable_hierarchical_cache=True), None),  # served (adapter/scale/hicache.py)
    ("hicache", dict(enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout="layer_first",
                     kv_cache_dtype="fp8_e4m3"), None),  # the CPU tests' transfer settings, an fp8 draft pool
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v))
@child_only
def test_served_under_the_experimental_flag_through_sglangs_own_resolution(plugin, pair, monkeypatch, feature, kw,
                                                                           served_match):
    """Under --speculative-dflash-experimental, through SGLang's own resolution: DP attention
    (adapter/scale/dp_attention.py) served with the lm_head split per group, refused without --enable-dp-lm-head;
    HiCache (adapter/scale/hicache.py) served; each where this release has what it needs (its probe), refused with the
    release named where it has not."""
    from dflash_sglang.adapter import versions
    from dflash_sglang.adapter.settings import UnsupportedFlagError

    probe, unserved, served = EXPERIMENTAL_FEATURES[feature]
    kw = {**kw, "speculative_dflash_experimental": True}
    missing = [f for f in _argv(Path("."), **kw) if f.startswith("--") and not _sglang_has_flag(f)]
    if missing:
        pytest.skip(f"sglang {version('sglang')} has no {' '.join(missing)}")
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    match = served_match if getattr(versions, probe)() else unserved.format(v=re.escape(version("sglang")))
    if match is not None:
        with pytest.raises(UnsupportedFlagError, match=match):
            _server_args(pair, **kw)
        return
    resolved = _server_args(pair, **kw)
    assert served(versions, versions.view(resolved))


@pytest.mark.parametrize("kw, dtype, element", [
    (dict(), "auto", 0),  # the model dtype (0: its element size)
    (dict(kv_cache_dtype="fp8_e4m3"), "fp8_e4m3", 1),  # the draft follows the target's KV dtype (0.5.17's only way)
    (dict(speculative_draft_kv_cache_dtype="fp8_e5m2"), "fp8_e5m2", 1),  # the draft pool alone
    (dict(speculative_draft_kv_cache_dtype="bf16"), "bf16", 2),
    (dict(kv_cache_dtype="fp8_e4m3", speculative_draft_kv_cache_dtype="auto"), "auto", 0),  # the draft flag wins
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v))
@child_only
def test_draft_kv_dtype_through_sglangs_own_resolution(plugin, pair, monkeypatch, kw, dtype, element):
    """--speculative-draft-kv-cache-dtype (default: follow --kv-cache-dtype) resolves into the worker's settings, with
    the pool row's bytes that SGLang's KV sizing will add per token (adapter/draft/memory.py) and the context length the
    start-up line prices a request at."""
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import model_config
    from dflash_sglang.core.draft.config import DraftConfig

    missing = [f for f in _argv(Path("."), **kw) if f.startswith("--") and not _sglang_has_flag(f)]
    if missing:
        pytest.skip(f"sglang {version('sglang')} has no {' '.join(missing)}")
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    server_args = _server_args(pair, **kw)
    s = settings_of(server_args)
    cfg = DraftConfig.load(pair / "draft")
    element = element or torch.empty((), dtype=model_config(server_args).dtype).element_size()
    assert s.draft_kv_dtype == dtype
    row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    assert s.draft_memory.bytes_per_token == row * element
    assert s.context_len > 0


@pytest.mark.parametrize("kw, ring, mode, topk, why", [
    # the radix cache off: the ring (no shape flag: the controller over chains only, as the ring serves chains)
    (dict(disable_radix_cache=True), True, "goodput", 1, "the radix cache is off"),
    (dict(disable_radix_cache=True, speculative_num_draft_tokens=6), True, "chain", 1, "the radix cache is off"),
    # ... under the draft graphs (the ring's key rows built on the device: ops.draft_kv_indices with a ring)
    (dict(disable_radix_cache=True, speculative_dflash_draft_graphs="static"), True, "goodput", 1,
     "the radix cache is off"),
    # SGLang's defaults (the radix cache on): the slot rows, with what they serve: the controller's trees, the draft
    # graphs
    (dict(), False, "goodput", 4, "the radix cache is on"),
    (dict(speculative_dflash_draft_graphs="static"), False, "goodput", 4, "the radix cache is on"),
    # the radix cache off, but trees: the slot rows (a tree's nodes share positions, by which the ring is indexed)
    (dict(disable_radix_cache=True, speculative_eagle_topk=2), False, "tree", 2, "tree verification"),
    # ... or PD (the transfer goes by target KV slot), or DP attention (where this SGLang serves them)
    (dict(disable_radix_cache=True, disaggregation_mode="decode", disaggregation_transfer_backend="mooncake"), False,
     "goodput", 4, "PD disaggregation"),
    (dict(disable_radix_cache=True, tp_size=2, attn_dp_size=2, enable_dp_lm_head=True,
          speculative_dflash_experimental=True), False, "goodput", 4, "DP attention"),
])
@child_only
def test_draft_window_resolution(plugin, pair, monkeypatch, kw, ring, mode, topk, why):
    """--speculative-draft-window-size W: with the radix cache off, a ring of R = W + N - 1 rows per request slot: 0
    B/token for SGLang's KV sizing (the hook adds nothing), R rows per request at any context length, a declared
    request cap (the rings are allocated per request slot before KV sizing), chains, the draft graphs as asked.
    Wherever the ring cannot serve (the radix cache on, SGLang's default; trees; PD; DP attention), the slot rows read
    over the last W positions: a row per token for the KV sizing, SGLang's own request cap, trees and the draft graphs
    as without a window. The reason is in the settings (the start-up line says it)."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative import dflash_utils

    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import attention_dp_served, pd_disaggregation_supported, resolved_value

    if ("disaggregation_mode" in kw and not pd_disaggregation_supported()) or ("attn_dp_size" in kw and not (
            _sglang_has_flag("--attn-dp-size") and attention_dp_served())):
        pytest.skip(f"sglang {version('sglang')} does not serve it (refused by name: see the refusal tests)")
    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    server_args = _server_args(pair, speculative_draft_window_size=16, **kw)
    s = settings_of(server_args)
    assert (s.mode, s.topk, s.draft_window) == (mode, topk, 16)
    assert s.draft_window_why.startswith(why), s.draft_window_why
    memory = s.draft_memory
    get_context().set_server_args(server_args)
    kv = dict(target_cell_size_per_token=1000, target_num_layers=4, draft_num_layers=2)
    assert s.draft_graphs == kw.get("speculative_dflash_draft_graphs", "auto")
    if ring:
        assert (memory.window, memory.ring, memory.bytes_per_token) == (16, 16 + s.max_nodes - 1, 0)
        assert memory.bytes_per_request(10) == memory.bytes_per_request(10**6) == memory.ring * memory.bytes_per_row
        assert s.max_running_requests == resolved_value(server_args, "max_running_requests") == 48
        assert dflash_utils.scale_kv_cell_size_per_token_for_dflash(**kv) == 1000
        return
    assert (memory.window, memory.ring) == (16, 0) and memory.bytes_per_token == memory.bytes_per_row > 0
    assert memory.bytes_per_request(100) == 100 * memory.bytes_per_row
    if mode == "goodput":
        assert s.max_running_requests is None  # SGLang's own, as without a window
    assert dflash_utils.scale_kv_cell_size_per_token_for_dflash(**kv) == 1000 + memory.bytes_per_row


@child_only
def test_kv_sizing_hook_adds_our_pool_row(plugin, pair, monkeypatch):
    """SGLang's `scale_kv_cell_size_per_token_for_dflash`, as the KV sizing calls it in the scheduler (hooked by the
    plugin): the target's bytes per token plus our pool row where our settings are in the runtime context; SGLang's
    own estimate without them."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative import dflash_utils

    from dflash_sglang.adapter.settings import settings_of

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    server_args = _server_args(pair, speculative_draft_kv_cache_dtype="fp8_e4m3") if _sglang_has_flag(
        "--speculative-draft-kv-cache-dtype") else _server_args(pair, kv_cache_dtype="fp8_e4m3")
    row = settings_of(server_args).draft_memory.bytes_per_token
    kw = dict(target_cell_size_per_token=1000, target_num_layers=4, draft_num_layers=2)
    get_context().set_server_args(server_args)  # as the scheduler publishes them before sizing its pools
    assert dflash_utils.scale_kv_cell_size_per_token_for_dflash(**kw) == 1000 + row
    monkeypatch.delattr(server_args, "_dflash_settings")  # another algorithm, or the builtin
    assert dflash_utils.scale_kv_cell_size_per_token_for_dflash(**kw) == 1500  # SGLang's layer-count scaling


@child_only
def test_post_capture_kv_sizing_is_refused(plugin, pair, monkeypatch):
    """SGLANG_ENABLE_POST_CAPTURE_KV_SIZING would grow the target KV pool past our draft pool (sized with it at
    start-up): refused at start-up, naming the variable; off, the server resolves."""
    from dflash_sglang.adapter.settings import UnsupportedFlagError

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "0")
    _server_args(pair)
    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "1")
    with pytest.raises(UnsupportedFlagError, match=r"^SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1: the target KV pool "
                                                   r"resized after CUDA-graph capture would outgrow our draft KV pool"):
        _server_args(pair)


@child_only
def test_pd_disaggregation_resolves_where_sglang_has_a_dflash_path(plugin, pair, monkeypatch):
    """--disaggregation-mode prefill / decode: served where SGLang's decode server builds DFLASH's relayed state from
    the transferred token (0.5.20 on), the side recorded in the settings; refused naming the release elsewhere."""
    from dflash_sglang.adapter.settings import UnsupportedFlagError
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import pd_disaggregation_supported

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    for mode in ("prefill", "decode"):
        kw = dict(disaggregation_mode=mode, disaggregation_transfer_backend="mooncake")
        if not pd_disaggregation_supported():  # (tests/test_sglang_versions.py checks the probe itself)
            with pytest.raises(UnsupportedFlagError, match=rf"^--disaggregation-mode {mode}: SGLang "
                                                           rf"{re.escape(version('sglang'))} has no "
                                                           r"DFLASH path for PD disaggregation"):
                _server_args(pair, **kw)
            continue
        assert settings_of(_server_args(pair, **kw)).disaggregation == mode
    assert settings_of(_server_args(pair)).disaggregation is None


@child_only
@pytest.mark.parametrize("watched", [True, False])
def test_pd_decode_retraction_backs_up_and_restores_the_draft_rows(plugin, monkeypatch, watched):
    """--disaggregation-decode-retraction-backup cpu_tensor (adapter/scale/retraction.py), through SGLang's own
    `Req.offload_kv_cache` / `Req.load_kv_cache` (what its `cpu_tensor` backup and restore call) on a real request, KV
    pool, allocator and req_to_token: the request's slots are freed, their rows reused by others, and it resumes at
    other slots. With the worker's watch (a PD decode server), its draft pass after the restore equals the one before
    the retraction bit for bit (the same drafts, so the same acceptance as never having retracted), a draft window
    over the slot rows included; without it, it differs (it would draft from the rows other requests left)."""
    from dflash_sglang.adapter.versions import pd_disaggregation_supported, req_kv_info

    if not pd_disaggregation_supported():
        pytest.skip(f"sglang {version('sglang')} has no DFLASH PD path (no decode server retracts)")
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    from dflash_sglang.adapter.draft.context_rows import SlotRows
    from dflash_sglang.adapter.draft.model import PagedDrafter
    from dflash_sglang.adapter.scale import retraction
    from factories import draft_config_for, tiny_drafter, tiny_target

    torch.manual_seed(0)
    size, block, row = 64, 4, 1
    target = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=2,
                              device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", target, need_sort=False)
    req_to_token = ReqToTokenPool(size=4, max_context_len=size, device="cpu", enable_memory_saver=False)
    cfg = draft_config_for(tiny_target("qwen3"), block_size=block)
    paged = PagedDrafter.load("unused", size + 1, 4, block, torch.float32, "cpu", weights=tiny_drafter(cfg),
                              context_rows=SlotRows(size + 1, window=8))
    monkeypatch.setattr(retraction, "_retraction", None)
    if watched:
        retraction.watch_retractions(paged.pool)
    params = SamplingParams(max_new_tokens=8)
    params.normalize(None)
    req = Req("r", "", list(range(1, 14)), params)
    req.output_ids = [3, 5, 7]  # 15 committed tokens with KV (the newest has none yet)
    if req_kv_info():
        req.kv.req_pool_idx = row
    else:
        req.req_pool_idx = row
    n = req.seqlen - 1
    slots = allocator.alloc(n)
    req_to_token.req_to_token[row, :n] = slots.to(torch.int32)
    for layer in range(2):  # the target KV SGLang backs up, and ours
        target.k_buffer[layer][slots] = torch.randn(n, 2, 8)
    paged.commit(torch.randn(n, cfg.n_features * cfg.hidden_size), torch.arange(n), slots)
    target_before = target.k_buffer[1][slots].clone()
    embeds = torch.randn(1, block, cfg.hidden_size)
    positions = n + torch.arange(block)[None]

    def draft():
        return paged.draft(embeds, positions, req_to_token.req_to_token, torch.tensor([row]), torch.tensor([n]))

    before = draft()
    req.offload_kv_cache(req_to_token, allocator)
    allocator.free(slots)
    others = allocator.alloc(size)  # every slot reused by other requests: their draft rows overwrite ours
    paged.commit(torch.randn(size, cfg.n_features * cfg.hidden_size), torch.arange(size), others)
    allocator.free(others)
    allocator.alloc(7)  # (the resumed request gets other slots than before)
    new_slots = allocator.alloc(n)
    assert not torch.equal(new_slots, slots)
    req_to_token.req_to_token[row, :n] = new_slots.to(torch.int32)
    req.load_kv_cache(req_to_token, allocator)
    assert torch.equal(target.k_buffer[1][new_slots], target_before)  # (SGLang's own restore of the target KV)
    after = draft()
    assert torch.equal(after, before) == watched
    assert getattr(req, retraction.BACKUP, None) is None


@child_only
def test_transferred_draft_pool_is_laid_out_as_sglangs_kv_pool(plugin):
    """The entries the transfer engine reads off our draft pool (adapter/scale/disagg.py) have the layout of SGLang's
    own MHATokenToKVPool of the same shape: K of every layer then V, one buffer each, the same byte lengths and bytes
    per page; page g of an entry starts at its pointer + g x bytes per page: target slots g*page.. of that layer."""
    import ctypes

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from dflash_sglang.adapter.scale.disagg import TransferredDraftPool
    from dflash_sglang.adapter.draft.pool import DraftKVPool

    size, layers, heads, dim = 16, 3, 2, 8
    for page in (1, 4):
        theirs = MHATokenToKVPool(size=size, page_size=page, dtype=torch.float32, head_num=heads, head_dim=dim,
                                  layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        pool = DraftKVPool(layers, size + page, heads, dim, torch.float32, "cpu")
        ours = TransferredDraftPool(pool, page)
        ptrs, lens, item_lens = ours.get_contiguous_buf_infos()
        _, their_lens, their_item_lens = theirs.get_contiguous_buf_infos()
        assert (lens, item_lens, ours.layer_num) == (their_lens, their_item_lens, theirs.layer_num)
        assert ptrs == [pool.k[i].data_ptr() for i in range(layers)] + [pool.v[i].data_ptr() for i in range(layers)]
        slot, layer = 6, 1
        pool.k[layer, slot] = torch.arange(heads * dim, dtype=torch.float32).view(heads, dim) + 100
        pool.v[layer, slot] = -5.0
        g, offset = divmod(slot, page)
        row = item_lens[0] // page
        k_at = ptrs[layer] + g * item_lens[layer] + offset * row
        assert ctypes.c_float.from_address(k_at).value == 100.0
        assert ctypes.c_float.from_address(k_at + row - 4).value == 100.0 + heads * dim - 1
        assert ctypes.c_float.from_address(ptrs[layers + layer] + g * item_lens[0] + offset * row).value == -5.0


@child_only
@pytest.mark.parametrize("case, match", [
    ("slots", None),  # one row per target slot, as many layers as the target or fewer: SIDECAR
    ("window", r"^--enable-hierarchical-cache with --speculative-draft-window-size: the window's ring keeps no "
               r"rows at the target's KV slots"),
    ("window_slots", None),  # a window over the slot rows offloads as without one
    ("deeper", r"^--enable-hierarchical-cache: the draft has 4 layers, more than the target's 3 HiCache transfer"),
    ("no_offload", None),  # no HiCache, no host-pool retraction backup: no plan
])
def test_hicache_draft_plan(plugin, monkeypatch, case, match):
    """adapter/scale/hicache.py `draft_plan`: SGLang's SIDECAR plan over our pool where KV goes to host memory; refused
    for a draft window's rings and for more draft layers than the target's transfer stages; none without offloading."""
    from dflash_sglang.adapter.scale import hicache
    from dflash_sglang.adapter.settings import UnsupportedFlagError
    from dflash_sglang.adapter.draft.context_rows import SlotRows, WindowRows
    from dflash_sglang.adapter.draft.pool import DraftKVPool
    from dflash_sglang.adapter.versions import hicache_draft_served

    if not hicache_draft_served():
        pytest.skip(f"sglang {version('sglang')}: no HiCache draft plan over a pool's buffer description")
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.speculative.base_spec_worker import HiCacheDraftMode

    monkeypatch.setattr(hicache, "offloads_to_host", lambda: case != "no_offload")
    target = MHATokenToKVPool(size=16, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=3,
                              device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    pool = DraftKVPool(4 if case == "deeper" else 2, 40, 2, 8, torch.float32, "cpu")
    rows = {"window": WindowRows(window=4, ring=8, req_slots=2), "window_slots": SlotRows(17, window=4)}.get(
        case, SlotRows(17))
    drafter = SimpleNamespace(pool=pool, context_rows=rows)
    if match is not None:
        with pytest.raises(UnsupportedFlagError, match=match):
            hicache.draft_plan(drafter, target)
        return
    plan = hicache.draft_plan(drafter, target)
    if case == "no_offload":
        assert plan.mode == HiCacheDraftMode.NONE and plan.device_pools == ()
        return
    [face] = plan.device_pools
    assert plan.mode == HiCacheDraftMode.SIDECAR and isinstance(face, MHATokenToKVPool) and face.size == 16
    assert [b.data_ptr() for b in face.k_buffer] == [pool.k[i].data_ptr() for i in range(2)]
    assert all(b.shape[0] == 17 for b in face.k_buffer + face.v_buffer)  # target slots only, no scratch


@child_only
@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("page", [1, 4])
def test_hicache_offloads_the_draft_context_rows_through_sglangs_host_pool(plugin, kv_dtype, page):
    """adapter/scale/hicache.py: our draft pool's face as SGLang's HiCache reads a draft pool: described as SGLang's own
    MHATokenToKVPool of the same shape describes itself (geometry, NHD per-layer buffers, pointer tables), only the rows
    at target slot ids (not the block scratch). SGLang's host pool for it, built as `build_full_draft_pools` builds a
    draft sidecar's, backs up some pages' rows (every layer) and loads them back layer by layer at other slot ids:
    exactly what the pool stored there (fp8 bytes included), the scratch rows untouched."""
    from dflash_sglang.adapter.versions import hicache_draft_served

    if not hicache_draft_served():
        pytest.skip(f"sglang {version('sglang')}: no HiCache draft plan over a pool's buffer description")
    from cpu_hicache import patch as patch_cpu_hicache
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _build_mha_mla_host_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from dflash_sglang.adapter.draft.pool import DraftKVPool, pool_rows
    from dflash_sglang.adapter.scale.hicache import HiCacheDraftPool
    from dflash_sglang.core.draft.draft_kv import kv_format

    patch_cpu_hicache()  # (SGLang's host pools on the CPU: tests/cpu_hicache.py)
    size, layers, heads, dim, block = 16, 2, 2, 8, 4
    target = MHATokenToKVPool(size=size, page_size=page, dtype=torch.float32, head_num=heads, head_dim=dim,
                              layer_num=layers + 1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    fmt = kv_format(kv_dtype, torch.float32) if kv_dtype else None
    pool = DraftKVPool(layers, pool_rows(size + page, 3, block), heads, dim, torch.float32, "cpu", kv_format=fmt)
    stored = pool.store(torch.randn(layers, pool.rows, heads, dim), torch.randn(layers, pool.rows, heads, dim))
    pool.k.copy_(stored[0])
    pool.v.copy_(stored[1])
    before_k, before_v = pool.k.clone(), pool.v.clone()
    face = HiCacheDraftPool(pool, target)
    ours, theirs = face.get_device_pool_infos()[0], target.get_device_pool_infos()[0]
    mine, their = ours.buffer_info, theirs.buffer_info
    assert (ours.pool_name.value, ours.indices_from_pool, ours.layer_ids) == ("draft", theirs.pool_name,
                                                                              tuple(range(layers)))
    assert (mine.page_size, mine.head_num, mine.head_dim, mine.v_head_dim, mine.buffers.layout) == (
        their.page_size, their.head_num, their.head_dim, their.v_head_dim, their.buffers.layout)
    assert mine.dtype == (torch.uint8 if fmt else torch.float32)  # fp8 rows as bytes, as SGLang stores its own
    for b, t in zip(mine.buffers.k + mine.buffers.v, their.buffers.k[:layers] + their.buffers.v[:layers]):
        assert (b.shape, b.stride(), b.nbytes) == (t.shape, t.stride(), t.nbytes * b.element_size() // 4)
    assert mine.buffers.k_data_ptrs.tolist() == [pool.k[i].data_ptr() for i in range(layers)]
    assert face.size == size and face.get_kv_size_bytes()[0] == layers * (size + page) * heads * dim * \
        pool.k.element_size()
    host = _build_mha_mla_host_pool(pool=face, host_to_device_ratio=2.0, page_size=page, layout="layer_first",
                                    allocator_type="default", pool_label="draft", host_token_capacity=2 * size)
    old = torch.arange(page, 3 * page) if page > 1 else torch.tensor([3, 7, 8])  # device slots backed up ...
    new = old + (size + page - 3 * page if page > 1 else 5)  # ... loaded back here
    slots = torch.arange(page, page + old.numel())  # host slots
    host.backup_from_device_all_layer(face, slots, old, "direct")
    pool.k[:, new] = pool.v[:, new] = torch.zeros((), dtype=pool.k.dtype)  # the slots reused meanwhile
    for layer in range(layers):
        host.load_to_device_per_layer(face, slots, new, layer, "direct")
    as_bytes = (lambda t: t.view(torch.uint8)) if fmt else (lambda t: t)
    assert torch.equal(as_bytes(pool.k[:, new]), as_bytes(before_k[:, old]))
    assert torch.equal(as_bytes(pool.v[:, new]), as_bytes(before_v[:, old]))
    scratch = slice(size + page, None)  # the block scratch: never described, never copied
    assert torch.equal(as_bytes(pool.k[:, scratch]), as_bytes(before_k[:, scratch]))


@child_only
@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_decode_side_reports_transfers_without_draft_kv(plugin, caplog, kv_dtype):
    """adapter/scale/disagg.py PeerCheck: the slots pre-allocated for a transfer are marked unsent (NaN, as the pool
    stores it); rows a transfer wrote pass; a request whose rows no transfer wrote is reported once per doubling, by
    request id, and its rows are zeroed (finite drafts); rows past a request's length and other requests' rows are
    left."""
    import logging
    from types import SimpleNamespace

    from dflash_sglang.adapter.draft.pool import DraftKVPool
    from dflash_sglang.adapter.scale.disagg import PeerCheck, TransferredDraftPool
    from dflash_sglang.core.draft.draft_kv import kv_format

    fmt = kv_format(kv_dtype, torch.float32) if kv_dtype else None
    pool = DraftKVPool(2, 32, 2, 4, torch.float32, "cpu", kv_format=fmt)
    ours = TransferredDraftPool(pool, 1)
    req_to_token = torch.zeros(4, 8, dtype=torch.int32)
    req_to_token[0, :5], req_to_token[1, :3], req_to_token[2, :4], req_to_token[3, :2] = (
        torch.arange(1, 6), torch.arange(10, 13), torch.arange(20, 24), torch.arange(26, 28))
    for first, n in ((1, 5), (10, 4), (20, 5), (26, 2)):  # each transfer's pre-allocated slots (request 1's: one more)
        ours.mark_unsent(torch.arange(first, first + n))
    sent = pool.store(torch.ones(5, 2, 4), torch.ones(5, 2, 4))[0]
    pool.k[0, 1:6] = sent  # request 0's transfer wrote its rows (the draft K/V of its prompt)
    pool.k[0, 20:22] = sent[:2]  # request 2's did half of them: a peer that sends none leaves them all
    # request 3 is SGLang's health check: a fake bootstrap host, no KV transferred (never reported)
    reqs = [SimpleNamespace(rid=f"r{i}", bootstrap_host="10.0.0.1") for i in range(3)]
    reqs.append(SimpleNamespace(rid="HEALTH_CHECK_x", bootstrap_host="2.2.2.2"))
    batch = SimpleNamespace(reqs=reqs, seq_lens=torch.tensor([5, 3, 4, 2]), seq_lens_cpu=torch.tensor([5, 3, 4, 2]),
                            req_pool_indices=torch.tensor([0, 1, 2, 3]),
                            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    check = PeerCheck(ours)
    with caplog.at_level(logging.ERROR, logger="dflash_sglang.adapter.scale.disagg"):
        check.check(batch)
    assert (check.checked, check.unsent) == (3, 2)
    [record] = caplog.records
    assert "2 of 3 transferred requests arrived without draft K/V (now: r1, r2)" in record.getMessage()
    loaded = pool.load(pool.k[0], pool.v[0])[0]
    assert not loaded[10:13].isnan().any() and not loaded[20:24].isnan().any()  # zeroed: finite drafts
    assert (loaded[10:13] == 0).all() and (loaded[22:24] == 0).all() and (loaded[20:22] == 1).all()
    assert loaded[1:6].eq(1).all()  # a transferred request's rows are untouched
    assert loaded[13].isnan().all()  # beyond request 1's length: pre-allocated, not yet its context
    assert loaded[26:28].isnan().all()  # the health check's rows: not a transfer, left as they are
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="dflash_sglang.adapter.scale.disagg"):
        check.check(batch)  # the same rows again: nothing unsent any more
    assert (check.checked, check.unsent) == (6, 2) and not caplog.records


@child_only
def test_tensor_expert_and_data_parallel_layouts_resolve(plugin, pair, monkeypatch):
    """TP, EP inside it (the target's experts; our collectives run on the TP group) and DP replicas (one scheduler and
    worker each, the same settings) are served."""
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import resolved_value

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    args = _server_args(pair, tp_size=2, ep_size=2)
    assert settings_of(args).mode == "goodput" and resolved_value(args, "ep_size") == 2
    replicas = _server_args(pair, dp_size=2)
    assert resolved_value(replicas, "dp_size") == 2 and settings_of(replicas) == settings_of(_server_args(pair))


def _sglang_has_flag(flag: str) -> bool:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return any(flag in action.option_strings for action in parser._actions)


@child_only
def test_tree_checks_read_what_sglang_picked(plugin, monkeypatch):
    """SGLang stashes its own choices (e.g. fa3 on Hopper when --attention-backend is unset) as declarations; the tree
    checks read them through the version seam's view and say so."""
    from dflash_sglang.adapter.boot import mode

    monkeypatch.setattr(mode, "model_config", lambda server_args: SimpleNamespace(hf_config={}))

    def fake(**declared):
        return SimpleNamespace(page_size=None, attention_backend=None, prefill_attention_backend=None,
                               decode_attention_backend=None, _resolved_overrides=[("sglang pass", declared)])

    mode.check_tree_serving(fake(attention_backend="flashinfer"), 10, "N", "trees")
    with pytest.raises(mode.UnsupportedFlagError,
                       match=r"^--attention-backend fa3: tree verification supports torch_native, flashinfer, triton "
                             r"target attention \(SGLang chose it for this model/GPU; pass --attention-backend"):
        mode.check_tree_serving(fake(attention_backend="fa3"), 10, "N", "trees")
    with pytest.raises(mode.UnsupportedFlagError, match=r"^--page-size 64: .* needs page size 1 \(SGLang chose it"):
        mode.check_tree_serving(fake(attention_backend="flashinfer", page_size=64), 10, "N", "trees")


@child_only
def test_worker_answers_the_draft_runner_members_itself(plugin, pair, monkeypatch):
    """SGLang 0.5.23 reads `primary_draft_kv_pool` and `preloaded_weights_bytes` off the spec worker; they must not
    fall through to the target worker (whose preloaded bytes would then be counted twice when sizing the KV pool)."""
    from dflash_sglang.adapter.step.worker import DFlashWorker

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    args = _server_args(pair)
    runner = SimpleNamespace(spec_aux_config=SimpleNamespace(dflash_target_layer_ids=None),
                             model_config=SimpleNamespace(context_len=512), dtype=torch.float32)
    target = SimpleNamespace(model_runner=runner, device="cpu", preloaded_weights_bytes=123,
                             primary_draft_kv_pool="target pool")
    worker = DFlashWorker(server_args=args, gpu_id=0, nccl_port=0, target_worker=target)
    assert worker.primary_draft_kv_pool is None and worker.preloaded_weights_bytes == 0
    assert worker.max_nodes == 6
    assert worker.schedule.describe() == ("goodput controller over chains of 1/2/3/4/6 rows (1: a plain step) and "
                                          "trees of 4/6 nodes over top-2/4, token budget 288")  # 48 x N
    assert DFlashWorker(server_args=args, gpu_id=0, nccl_port=0, target_worker=target, ps=object()).max_nodes == 6


def _req(**kw):
    params = SimpleNamespace(**{"json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
                                "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                "min_new_tokens": 0, **kw.pop("params", {})})
    return SimpleNamespace(**{"origin_input_ids": [1, 2, 3], "vocab_size": 16, "sampling_params": params,
                              "return_logprob": False, "custom_logit_processor": None, "return_hidden_states": False,
                              **kw})


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(origin_input_ids=[1, 16, 2]), r"input token id 16 is outside the target vocabulary \[0, 16\)"),
        (dict(origin_input_ids=[-1]), r"input token id -1 is outside"),
        (dict(origin_input_ids=[]), r"empty prompt \(no input tokens\)"),
        (dict(custom_logit_processor="serialized"), "custom logit processors"),
    ],
)
@child_only
def test_requests_our_worker_would_serve_differently_are_refused(plugin, monkeypatch, kw, match):
    from sglang.srt.speculative import dflash_utils

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    assert dflash_utils.validate_dflash_request(_req(), enable_overlap=False) is None
    # logprobs are served (SGLang 0.5.17 alone would refuse them for DFLASH), hidden states, penalties and
    # min_new_tokens too
    assert dflash_utils.validate_dflash_request(_req(return_logprob=True), enable_overlap=False) is None
    assert dflash_utils.validate_dflash_request(_req(return_hidden_states=True), enable_overlap=False) is None
    served = {"frequency_penalty": 0.5, "presence_penalty": -0.2, "repetition_penalty": 1.3, "min_new_tokens": 3}
    assert dflash_utils.validate_dflash_request(_req(params=served), enable_overlap=False) is None
    error = dflash_utils.validate_dflash_request(_req(**kw), enable_overlap=False)
    assert error is not None and error.startswith("DFLASH (dflash-sglang)") and re.search(match, error), error


@child_only
def test_refusals_happen_on_the_tokenizer_side(plugin, monkeypatch):
    """The tokenizer manager's per-request validation raises our refusal (a 400 / one stream error event, before
    scheduling), only where our DFLASH worker serves and only for generate requests."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    monkeypatch.delenv(plugin.IMPL_ENV, raising=False)
    assert plugin.VALIDATE_INPUT == f"{TokenizerManager.__module__}.TokenizerManager._validate_one_request"
    seen = []

    def original(*args):
        seen.append(args)

    manager = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="DFLASH"),
                              model_config=SimpleNamespace(vocab_size=16))
    ok = SimpleNamespace(sampling_params={"frequency_penalty": 0.3}, custom_logit_processor=None,
                         return_hidden_states=False)
    plugin._validate_input(original, manager, ok, [1, 2])
    assert len(seen) == 1  # SGLang's own checks ran first
    plugin._validate_input(original, manager, SimpleNamespace(**{**vars(ok), "return_hidden_states": True}), [1])
    for obj, ids, match in ((SimpleNamespace(**{**vars(ok), "custom_logit_processor": "x"}), [1], "custom logit"),
                            (ok, [1, 16], "outside the target vocabulary"), (ok, [], "empty prompt")):
        with pytest.raises(ValueError, match=match):
            plugin._validate_input(original, manager, obj, ids)
    custom = SimpleNamespace(**{**vars(ok), "custom_logit_processor": "x"})
    plugin._validate_input(original, SimpleNamespace(**{**vars(manager), "server_args": SimpleNamespace(
        speculative_algorithm="EAGLE")}), custom, [1])  # another algorithm: not ours to refuse
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    plugin._validate_input(original, manager, custom, [1])  # the builtin serves: its own rules


@child_only
def test_builtin_dflash_verify_drops_the_repetition_penalty(plugin):
    """A fact docs/request-options.md states: SGLang's builtin DFLASH verify (`apply_dflash_verify_logits_adjustments`,
    both versions) builds the penalties by applying the penalizers to a zero tensor and adds that to every verify row,
    so the multiplicative repetition penalty scales zeros and has no effect, where plain decoding divides the logit."""
    from sglang.srt.sampling.penaltylib import BatchedPenalizerOrchestrator, BatchedRepetitionPenalizer
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments

    class Batch:  # the orchestrator keeps a weak reference to its batch
        reqs = [SimpleNamespace(sampling_params=SimpleNamespace(repetition_penalty=1.6))]
        device = "cpu"

    batch = Batch()
    orchestrator = BatchedPenalizerOrchestrator(8, batch, {BatchedRepetitionPenalizer})
    orchestrator.cumulate_output_tokens(torch.tensor([3]))  # token 3 was output
    info = object.__new__(SamplingBatchInfo)
    for name, value in dict(temperatures=torch.ones(1, 1), penalizer_orchestrator=orchestrator, logit_bias=None,
                            acc_additive_penalties=None, acc_scaling_penalties=None, grammar_mask=None,
                            has_custom_logit_processor=False).items():
        object.__setattr__(info, name, value)
    row = [1.0, -1.0, 0.5, 2.0, 0.25, 0.0, 0.0, 0.0]
    plain = torch.tensor([row])
    info.apply_logits_bias(plain)  # plain decoding's sampling step
    assert plain[0, 3] == 2.0 / 1.6
    verify = torch.tensor([row] * 4)  # four verify rows of one request
    apply_dflash_verify_logits_adjustments(next_token_logits=verify, sampling_info=info, draft_token_num=4)
    assert torch.equal(verify, torch.tensor([row] * 4))  # untouched


@child_only
def test_every_setting_is_documented():
    """README's flag table and the serving guide's settings (docs/serving-flags.md) name every setting, and every
    retired variable with its flag."""
    from dflash_sglang.adapter.boot.flags import RETIRED_ENV, SETTINGS

    repo = Path(__file__).resolve().parents[1]
    readme, guide = (repo / "README.md").read_text(), (repo / "docs" / "serving-flags.md").read_text()
    for s in SETTINGS:
        assert f"`{s.flag}" in readme and f"`{s.flag}" in guide, s.flag
    for name in RETIRED_ENV:
        assert name in guide, name
