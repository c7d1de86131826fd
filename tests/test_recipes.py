"""Every deployment recipe parses with SGLang's own ServerArgs and uses a known draft/target pair correctly.

SGLang is parsed in a subprocess (one for all recipes): on this CPU machine it needs the import shims of
tests/sglang_shims, which must not leak into the pytest process. No GPU and no model download is needed: the
argv is parsed by `ServerArgs.add_cli_args`, and `ServerArgs.from_cli_args` runs with model_path "dummy" (its
documented early exit), so hardware probing and hub access never happen.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_sglang.bench.serving import recipe as recipes
from dflash_sglang.pairs import PAIRS, check_deployment, pair_for

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ROOT / "tests" / "sglang_shims"

ALL = [(name, hw) for name in recipes.names() for hw in recipes.load(name).hw]

# Runs in the subprocess: parse each argv with SGLang and report what SGLang saw.
_PARSE = r"""
import argparse, contextlib, copy, io, json, sys, types
try:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
except ImportError as e:
    print("IMPORT_ERROR " + f"{type(e).__name__}: {e}")
    sys.exit(0)
try:
    from sglang.srt.arg_groups.speculative_hook import _resolve_dflash_draft_attention_backend as resolve_draft
except ImportError:
    resolve_draft = None
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
# our flags, as the plugin adds them to the server's parser (recipes pass --speculative-dflash-experimental to ours)
from dflash_sglang.adapter.boot.flags import add_plugin_flags, split_plugin_flags
add_plugin_flags(parser)
hidden = {o for a in parser._actions for o in a.option_strings
          if a.help == argparse.SUPPRESS or (a.help or "").lower().startswith("deprecated")}
out = []
for job in json.load(sys.stdin):
    argv = job["argv"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        out.append({"error": err.getvalue().strip().splitlines()[-1]})
        continue
    dummy = argparse.Namespace(**split_plugin_flags(vars(ns))[1])
    dummy.model_path = "dummy"
    ServerArgs.from_cli_args(dummy)
    rec = {"error": None, "model_path": ns.model_path, "tp_size": ns.tp_size,
           "draft": ns.speculative_draft_model_path, "block_size": ns.speculative_num_draft_tokens,
           "algorithm": ns.speculative_algorithm, "attention_backend": ns.attention_backend,
           "hidden_flags": sorted(t for t in argv if t in hidden), "draft_backend_kept": None}
    if ns.speculative_algorithm:
        rec["algorithm_ok"] = SpeculativeAlgorithm.from_string(ns.speculative_algorithm).is_dflash()
        backend = ns.speculative_draft_attention_backend
        if resolve_draft is not None and backend != "trtllm_mha":
            probe = types.SimpleNamespace(speculative_draft_attention_backend=backend)
            resolve_draft(probe)
            rec["draft_backend_kept"] = probe.speculative_draft_attention_backend == backend
    if job["ours"]:
        # Our worker's own start-up flag checks on what SGLang parsed (device set to cpu: the flags, not this
        # machine's missing GPU packages, are under test).
        from dflash_sglang.adapter.boot.refusals import check_supported_flags
        from dflash_sglang.adapter.boot.draft_checks import draft_attention
        probe = copy.copy(ns)
        probe.device = "cpu"
        try:
            check_supported_flags(probe)
            draft_attention(ns.speculative_draft_attention_backend, "cuda")
            rec["ours_error"] = None
        except Exception as e:
            rec["ours_error"] = f"{type(e).__name__}: {e}"
    out.append(rec)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed() -> dict[tuple[str, str, str], dict]:
    """SGLang's view of every (recipe, hw, impl) argv."""
    keys, argvs = [], []
    for name, hw in ALL:
        r = recipes.load(name)
        for impl in ("spec", "none"):  # spec: the table's default DFLASH worker (ours, or builtin where ours can't)
            keys.append((name, hw, impl))
            chosen = r.default_impl(hw) if impl == "spec" else "none"
            argvs.append({"argv": r.server_args(hw, chosen), "ours": chosen == "ours"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SHIMS), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _PARSE], input=json.dumps(argvs), env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.stdout.startswith("IMPORT_ERROR "):
        pytest.skip("SGLang's ServerArgs is not importable (install it with .ci/install_sglang.sh): "
                    + proc.stdout[len("IMPORT_ERROR "):].strip())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return dict(zip(keys, json.loads(lines[-1][len("RESULT "):])))


def test_recipes_exist_for_every_published_pair_and_hardware():
    """One recipe per known pair; a recipe covers every GPU unless its header says why a table is omitted (a model
    that cannot fit, e.g. Kimi-K2.5 on 8 x 80 GB H100), as `HW: omitted -- reason`."""
    drafts = {recipes.load(n).draft for n in recipes.names()}
    assert drafts == set(PAIRS), "one recipe per known pair"
    for name in recipes.names():
        r = recipes.load(name)
        assert r.hw and set(r.hw) <= set(recipes.HARDWARE), name
        for hw in set(recipes.HARDWARE) - set(r.hw):
            assert re.search(rf"^{hw}: omitted -- \S", r.header, re.M), f"{r.path}: no [hw.{hw}], no reason in header"


# The published draft configs of the newer pairs (the fields our loader reads; sources in dflash_sglang/pairs.py and
# each recipe's header), and the targets' layer layout: what the `builtin_only` reasons rest on. The Kimi transcription
# has no block_size / intermediate_size: 8 is the card's --speculative-num-draft-tokens, 18432 a GGUF conversion's.
_PUBLISHED_DRAFTS = {
    "z-lab/gemma-4-31B-it-DFlash": {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
        "dflash_config": {"mask_token_id": 4, "target_layer_ids": [1, 12, 23, 35, 46, 57]},
        "final_logit_softcapping": 30.0, "head_dim": 128, "hidden_size": 5376, "intermediate_size": 10752,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
        "num_attention_heads": 64, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 60,
        "rope_theta": 1000000, "vocab_size": 262144},
    "z-lab/Kimi-K2.5-DFlash": {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
        "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
        "head_dim": 128, "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
        "num_hidden_layers": 6, "num_key_value_heads": 8, "num_target_layers": 61, "rope_theta": 50000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
        "vocab_size": 163840},
    # (block_size: the file's dflash_config.block_size, repeated at the top level where this test reads it)
    "z-lab/Muse-Glimmer-30B-DFlash2": {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                          "final_logit_softcapping": 20.0, "mask_token_id": 201818,
                          "output_multiplier": 0.19611613513818404, "selector_rank": 256, "selector_top_k": 16,
                          "target_layer_ids": [1, 13, 25, 37, 49]},
        "block_size": 16, "head_dim": 128, "hidden_size": 6656, "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5, "num_attention_heads": 32, "num_hidden_layers": 5,
        "num_key_value_heads": 8, "num_target_layers": 52, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "sliding_window": 2048,
        "use_sliding_window": True, "vocab_size": 202048},
    "z-lab/Qwen3.6-27B-DFlash": {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
        "head_dim": 128, "hidden_size": 5120, "intermediate_size": 17408,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
        "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 64,
        "rope_theta": 10000000, "vocab_size": 248320},
}
_TARGET_LAYOUT = {
    "google/gemma-4-31B-it": {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": {
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10}},
    "meta-models/Muse-Glimmer-30B": {"architectures": ["MuseGlimmerForConditionalGeneration"],
                                     "model_type": "muse_glimmer"},
    "moonshotai/Kimi-K2.5": {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                             "text_config": {"model_type": "deepseek_v3"}},
    "Qwen/Qwen3.6-27B": {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {
        "model_type": "qwen3_5_text", "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16}},
}


@pytest.mark.parametrize("draft", sorted(_PUBLISHED_DRAFTS))
def test_builtin_only_reasons_match_our_startup_checks(draft):
    """The published config agrees with dflash_sglang.pairs; a recipe is builtin-only exactly where our own start-up
    checks refuse the pair (checkpoint loader, or a recurrent target that is not Gated DeltaNet), with a reason naming
    the builtin; and experimental exactly where ours needs --speculative-dflash-experimental (a Gated DeltaNet target,
    a soft-capped draft), which the recipe then passes to ours and only to ours."""
    from dflash_sglang.core.draft.config import CheckpointError, DraftConfig, gated_deltanet, recurrent_layers

    pair, d = PAIRS[draft], _PUBLISHED_DRAFTS[draft]
    t = pair.target
    assert (d["block_size"], tuple(d["dflash_config"]["target_layer_ids"])) == (pair.block_size, pair.target_layer_ids)
    assert (d["hidden_size"], d["vocab_size"], d["num_target_layers"]) == (t.hidden_size, t.vocab_size, t.num_layers)
    assert d["num_attention_heads"] == pair.draft_num_heads
    refusals, experimental = [], False
    try:
        experimental = DraftConfig.from_dict(d, f"{draft}/config.json").final_logit_softcapping is not None
    except CheckpointError as e:
        refusals.append(str(e))
    if (hybrid := recurrent_layers(_TARGET_LAYOUT[t.repo])) is not None:
        if gated_deltanet(_TARGET_LAYOUT[t.repo]):
            experimental = True
        else:
            refusals.append(hybrid)
    (name,) = [n for n in recipes.names() if recipes.load(n).draft == draft]
    r = recipes.load(name)
    assert r.experimental == experimental, (name, r.experimental)
    for hw, h in r.hw.items():
        assert bool(h.builtin_only) == bool(refusals), (name, hw, refusals)
        assert not h.builtin_only or "DFLASH_SGLANG_IMPL=builtin" in h.builtin_only, (name, hw)
        if not refusals:
            flag = "--speculative-dflash-experimental"
            assert (flag in r.server_args(hw, "ours")) == experimental, (name, hw)
            assert flag not in r.server_args(hw, "builtin") + r.server_args(hw, "none"), (name, hw)


@pytest.mark.parametrize("name,hw", ALL)
def test_recipe_parses_with_sglang(parsed, name, hw):
    r = recipes.load(name)
    for impl in ("spec", "none"):
        got = parsed[(name, hw, impl)]
        assert got["error"] is None, f"{name}:{hw} ({impl}): SGLang rejected the argv: {got['error']}"
        assert got["hidden_flags"] == [], f"{name}:{hw}: deprecated/hidden SGLang flags {got['hidden_flags']}"
        assert got["model_path"] == r.target and got["tp_size"] == r.on(hw).tp
    spec, base = parsed[(name, hw, "spec")], parsed[(name, hw, "none")]
    assert spec["algorithm"] == "DFLASH" and spec["algorithm_ok"]
    assert spec["draft"] == r.draft and spec["block_size"] == r.block_size
    assert spec["draft_backend_kept"] in (True, None), (
        f"SGLang would replace draft backend {r.on(hw).draft_attention_backend}")
    assert base["algorithm"] is None and base["draft"] is None


@pytest.mark.parametrize("name,hw", ALL)
def test_recipe_uses_a_known_pair(parsed, name, hw):
    """The pairing rules are checked on the values SGLang parsed, i.e. on what would be served."""
    got = parsed[(name, hw, "spec")]
    assert check_deployment(got["draft"], got["model_path"], got["block_size"], got["tp_size"]) == []


@pytest.mark.parametrize("name,hw", ALL)
def test_default_worker_accepts_the_recipe(parsed, name, hw):
    """Where a table defaults to our worker, our start-up flag checks accept what SGLang parsed; where our worker
    refuses the table (`builtin_only`), the default is the builtin and asking for ours is a RecipeError naming the
    field. TP > 1 tables run ours (tensor parallelism is served)."""
    r = recipes.load(name)
    if r.default_impl(hw) == "ours":
        assert parsed[(name, hw, "spec")]["ours_error"] is None, parsed[(name, hw, "spec")]["ours_error"]
        assert r.server_env(hw)[recipes.IMPL_ENV] == "ours"
    else:
        assert r.on(hw).builtin_only and r.server_env(hw)[recipes.IMPL_ENV] == "builtin"
        with pytest.raises(recipes.RecipeError, match=r"\[hw\.%s\]: field 'builtin_only' = .*--impl builtin" % hw):
            r.server_args(hw, "ours")


@pytest.mark.parametrize("hw,backend", [("h100", "fa4"), ("h200", "trtllm_mha"), ("b200", "fa3")])
def test_backend_must_run_on_the_hardware(tmp_path, hw, backend):
    text = recipes.load("qwen3-8b").path.read_text()
    table = text.index(f"[hw.{hw}]")
    line = text.index("attention_backend", table)
    bad = tmp_path / "bad.toml"
    bad.write_text(text[:line] + f'attention_backend = "{backend}"' + text[text.index("\n", line):])
    with pytest.raises(recipes.RecipeError,
                       match=rf"\[hw\.{hw}\]: field 'attention_backend' = '{backend}' does not run"):
        recipes.load(bad)


@pytest.mark.parametrize("name,hw", ALL)
def test_recipe_is_small_and_carries_its_result(name, hw):
    r = recipes.load(name)
    h = r.on(hw)
    assert h.measured, "every hardware states its measured result or 'not yet measured'"
    assert f"{hw}: {h.measured}" in r.header, f"{r.path}: header comment out of sync with [hw.{hw}].measured"
    assert sorted(h.cuda_graph_bs) == list(h.cuda_graph_bs) and max(h.cuda_graph_bs) == h.max_running_requests
    assert 0.5 <= h.mem_fraction_static <= 0.95
    env = r.server_env(hw, "builtin")
    assert env[recipes.IMPL_ENV] == "builtin" and recipes.IMPL_ENV not in r.server_env(hw, "none")


def test_check_deployment_rejects_bad_pairings():
    p = PAIRS["z-lab/Qwen3-8B-DFlash-b16"]
    assert check_deployment(p.draft, p.target.repo, 16, 1) == []
    assert check_deployment("/models/Qwen3-8B-DFlash-b16", "/models/Qwen3-8B", 16, 2) == []  # local copies
    assert any("belongs to target" in e for e in check_deployment(p.draft, "Qwen/Qwen3-4B", 16, 1))
    assert any("block size 8" in e for e in check_deployment(p.draft, p.target.repo, 8, 1))
    assert any("does not divide" in e for e in check_deployment(p.draft, p.target.repo, 16, 3))
    assert any("unknown DFlash draft" in e for e in check_deployment("someone/other-draft", "x", 16, 1))
    coder = PAIRS["z-lab/Qwen3-Coder-30B-A3B-DFlash"]  # 4 KV heads: tp 8 replicates them evenly
    assert check_deployment(coder.draft, coder.target.repo, 16, 8) == []


def test_pairs_are_self_consistent():
    from dflash_sglang.core.draft.config import build_target_layer_ids

    for draft, p in PAIRS.items():
        assert pair_for(draft) is p and p.draft.startswith("z-lab/") and 2 <= p.block_size <= 16
        assert (p.target_layer_ids is None) == (p.layer_ids_source == "checkpoint")
        if p.target_layer_ids is not None and p.target.num_layers is not None:
            assert all(0 <= i < p.target.num_layers for i in p.target_layer_ids)
            assert list(p.target_layer_ids) == sorted(set(p.target_layer_ids))
            if p.layer_ids_source == "rule":
                assert p.target_layer_ids == build_target_layer_ids(p.target.num_layers, len(p.target_layer_ids))
        assert p.target.decode_gb is None or p.target.decode_gb > 0
        assert p.draft_gb is None or p.draft_gb > 0


def test_unverified_facts_are_named_not_guessed(capsys):
    """A pair with facts no published source gave us (None in dflash_sglang.pairs) says so in its recipe's header and
    through the launcher; the checks that need them are not made here (SGLang and our start-up checks read the
    checkpoints), and a roofline of its hub ids is refused rather than computed from a guess."""
    from dflash_sglang.bench.serving import roofline
    unverified = {d: p.unverified for d, p in PAIRS.items() if p.unverified}
    assert "z-lab/Qwen3.8-27B-DFlash2" in unverified
    assert not {d for d, p in PAIRS.items() if p.draft_gb is None or p.target.decode_gb is None} - set(unverified)
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import launch
    finally:
        sys.path.pop(0)
    for draft, facts in unverified.items():
        (name,) = [n for n in recipes.names() if recipes.load(n).draft == draft]
        assert re.search(r"^Unverified", recipes.load(name).header, re.M), name
        assert launch.main([name, "h200", "--dry-run"]) == 0
        assert ", ".join(facts) in capsys.readouterr().err
        with pytest.raises(KeyError, match="unverified"):
            roofline.for_models(roofline.hardware("h200"), PAIRS[draft].target.repo, draft)


def test_launcher_dry_run_prints_the_recipe_command(capsys):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import launch
    finally:
        sys.path.pop(0)
    assert launch.main(["qwen3-8b", "h100", "--impl", "builtin", "--dry-run", "--", "--port", "31000"]) == 0
    out = capsys.readouterr()
    assert "not yet measured" in out.err
    cmd = out.out.strip()
    assert cmd.startswith("DFLASH_SGLANG_IMPL=builtin python -m sglang.launch_server --model-path Qwen/Qwen3-8B")
    assert "--speculative-num-draft-tokens 16" in cmd and cmd.endswith("--port 31000")


def test_pd_sides_add_the_disaggregation_flags(capsys):
    """--pd prefill / decode (recipes/pd.md): the recipe's server plus PD disaggregation over mooncake; only the
    prefill side listens for bootstrap; anything else is refused."""
    r = recipes.load("qwen3-8b")
    whole = r.server_args("h100", "ours")
    prefill = r.server_args("h100", "ours", pd="prefill", bootstrap_port=9001)
    decode = r.server_args("h100", "ours", pd="decode")
    assert prefill[:len(whole)] == whole == decode[:len(whole)]
    assert prefill[len(whole):] == ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
                                    "--disaggregation-bootstrap-port", "9001"]
    assert decode[len(whole):] == ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    with pytest.raises(ValueError, match="pd must be one of"):
        r.server_args("h100", "ours", pd="both")
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import launch
    finally:
        sys.path.pop(0)
    assert launch.main(["qwen3-8b", "b200", "--pd", "decode", "--dry-run", "--", "--port", "30001"]) == 0
    cmd = capsys.readouterr().out.strip()
    assert "--disaggregation-mode decode --disaggregation-transfer-backend mooncake --port 30001" in cmd


def test_launcher_names_an_omitted_table():
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import launch
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit, match=r"no \[hw\.h100\] table.*h100: omitted -- "):
        launch.main(["kimi-k2.5", "h100", "--dry-run"])


def test_malformed_recipe_names_the_field(tmp_path):
    bad = tmp_path / "x.toml"
    head = 'name = "x"\ntarget = "t"\ndraft = "d"\nblock_size = 16\n'
    bad.write_text(head + '[hw.h100]\ntp = 1\n')
    with pytest.raises(recipes.RecipeError, match=r"\[hw.h100\]: missing field 'cuda_graph_bs'"):
        recipes.load(bad)
    bad.write_text(head + '[hw.h100]\ncuda_graph_bs = [1]\ntp = "one"\n')
    with pytest.raises(recipes.RecipeError, match=r"\[hw.h100\]: field 'tp' must be int"):
        recipes.load(bad)
    bad.write_text(head + '[hw.a100]\n')
    with pytest.raises(recipes.RecipeError, match="unknown hardware"):
        recipes.load(bad)
