"""The throughput stage's verdicts, targets and plan without an Engine: failing figures give FAIL / slower, the
Qwen3-8B-shaped pair's configs, the CPU rehearsal's tiny pair of the same architectures, and the order of the cells.
The stage itself runs in the CPU rehearsal (`bash scripts/gpu_session.sh --device cpu`)."""
from __future__ import annotations

import json

import pytest

from dflash_sglang.bench.gpu.context import Table
from dflash_sglang.bench.gpu.targets import QWEN3_8B_SHAPE, QWEN3_TINY, qwen3_8b_pair, qwen3_configs
from dflash_sglang.bench.gpu.throughput import (BLOCK, NONE, accept_figure, accept_tolerance, arms, cells, chain_sd,
                                                rate_for_tau, simulation_check, speed_rows, versus_builtin)
from dflash_sglang.core.draft.config import DraftConfig


def _result(committed: int, steps: int, requests: int = 1) -> dict:
    """An Engine result whose `requests` (one round) committed `committed` tokens in `steps` verify steps in all, each
    request a prefill token more."""
    return {"rounds": [{"key": "c1.r0", "ids": [[7] * (committed // requests + 1)] * requests,
                        "verify_ct": [steps // requests] * requests, "accept": [None] * requests}]}


def _row(arm: str, c: int, tok_s: float | None, ratio: float | None = None) -> dict:
    """One of measure/passes.py summarize's rows (the fields speed_rows reads)."""
    return {"arm": arm, "c": c, "tok_s": tok_s, "ratio": ratio, "accept_mean": None, "ms_per_step": None}


# ---------------------------------------------------------------------------------------------- simulated acceptance
def test_the_chain_law_matches_a_direct_sample():
    import random

    tau, rng = 4.0, random.Random(0)
    p = rate_for_tau(tau)
    draws = []
    for _ in range(20000):
        k = 1
        while k < BLOCK and rng.random() < p:
            k += 1
        draws.append(k)
    mean = sum(draws) / len(draws)
    sd = (sum((d - mean) ** 2 for d in draws) / len(draws)) ** 0.5
    assert mean == pytest.approx(tau, abs=0.1) and sd == pytest.approx(chain_sd(tau), rel=0.05)


def test_the_tolerance_is_ten_percent_unless_the_sample_is_small():
    assert accept_tolerance(4.0, 10_000) == pytest.approx(0.4)
    small = accept_tolerance(4.0, 20)
    assert small == pytest.approx(3 * chain_sd(4.0) / 20**0.5) and small > 0.4


def test_accept_figure_counts_verify_steps_without_the_prefill_token_and_a_batch_step_once():
    assert accept_figure(_result(2900, 1000, requests=4)) == (2.9, 250)  # (4 requests share each step's draw)
    assert accept_figure({"rounds": [{"ids": [[1, 2, 3]], "verify_ct": [None]}]}) is None  # (no speculation)


@pytest.mark.parametrize("arm,accept,draws,ok", [
    ("ours_chain", 2.9, 1000, False), ("builtin", 2.9, 1000, False), ("ours_controller", 2.9, 1000, True),
    ("ours_chain", 4.3, 1000, True), ("ours_chain", 4.5, 1000, False), ("ours_controller", 4.5, 1000, False),
    ("ours_chain", 2.9, 20, True)])  # (20 draws: 3 standard errors are ~2.2 tokens)
def test_an_arm_off_its_tau_fails(arm, accept, draws, ok):
    verdict = simulation_check(arm, 4.0, (accept, draws))
    assert (verdict is None) == ok
    if not ok:
        assert verdict == f"FAIL: simulation off (accept length {accept:.2f} at tau 4)"
    assert simulation_check(arm, 4.0, None).startswith("FAIL: no accept length")


# ---------------------------------------------------------------------------------------------- verdicts per row
@pytest.mark.parametrize("ratio,word", [(1.12, "faster: 1.12x builtin"), (1.05, "faster: 1.05x builtin"),
                                        (0.98, "same: 0.98x builtin"), (0.95, "slower: 0.95x builtin"),
                                        (0.5, "slower: 0.50x builtin")])
def test_ours_against_the_builtin_in_words(ratio, word):
    assert versus_builtin(ratio) == word


def _verdicts(rows, results) -> dict[tuple[str, float | None, int], str]:
    return {(r["arm"], r["tau"], r["c"]): r["verdict"] for r in speed_rows(rows, results)}


def test_a_slower_ours_makes_the_stage_slower():
    results = {NONE: _result(0, 0), "ours_chain@4": _result(4000, 1000), "builtin@4": _result(4000, 1000)}
    rows = [_row(NONE, 1, 100.0), _row("ours_chain@4", 1, 150.0, 1.5), _row("builtin@4", 1, 300.0, 3.0),
            _row("ours_chain@4", 8, 310.0, 2.0), _row("builtin@4", 8, 300.0, 2.0)]
    verdicts = _verdicts(rows, results)
    assert verdicts == {(NONE, None, 1): "pass", ("ours_chain", 4.0, 1): "slower: 0.50x builtin",
                        ("builtin", 4.0, 1): "pass: 3.00x none", ("ours_chain", 4.0, 8): "same: 1.03x builtin",
                        ("builtin", 4.0, 8): "pass: 2.00x none"}
    table = Table("t", ["verdict"], rows=[{"verdict": v} for v in verdicts.values()])
    assert table.status() == "slower"
    assert speed_rows(rows, results)[1]["vs builtin"] == 0.5


def test_an_arm_off_its_tau_fails_every_row_and_its_builtin_is_no_yardstick():
    results = {NONE: _result(0, 0), "ours_chain@4": _result(2900, 1000), "builtin@4": _result(2000, 1000),
               "ours_controller@4": _result(3000, 1000)}
    rows = [_row(NONE, 1, 100.0), _row("ours_chain@4", 1, 150.0, 1.5), _row("ours_chain@4", 8, 150.0, 1.5),
            _row("builtin@4", 1, 300.0, 3.0), _row("ours_controller@4", 1, 200.0, 2.0)]
    verdicts = _verdicts(rows, results)
    assert verdicts[("ours_chain", 4.0, 1)] == verdicts[("ours_chain", 4.0, 8)] == (
        "FAIL: simulation off (accept length 2.90 at tau 4)")
    assert verdicts[("builtin", 4.0, 1)] == "FAIL: simulation off (accept length 2.00 at tau 4)"
    assert verdicts[("ours_controller", 4.0, 1)] == "pass: 2.00x none"  # (below tau: allowed; no builtin to compare)
    assert Table("t", ["verdict"], rows=[{"verdict": v} for v in verdicts.values()]).status() == "failed"


def test_a_row_without_a_figure_fails_and_cpu_rows_compare_with_none_only():
    results = {NONE: _result(0, 0), "ours_chain@4": _result(4000, 1000)}
    rows = [_row(NONE, 1, None), _row("ours_chain@4", 1, None), _row("ours_chain@4", 2, 90.0, 1.8)]
    verdicts = _verdicts(rows, results)
    assert verdicts == {(NONE, None, 1): "FAIL: no tokens/s figure", ("ours_chain", 4.0, 1): "FAIL: no tokens/s figure",
                        ("ours_chain", 4.0, 2): "pass: 1.80x none"}
    no_steps = {"ours_chain@4": {"rounds": [{"ids": [[1, 2]], "verify_ct": [0]}]}}
    assert _verdicts([_row("ours_chain@4", 1, 90.0)], no_steps)[("ours_chain", 4.0, 1)].startswith(
        "FAIL: no accept length")


# ---------------------------------------------------------------------------------------------- targets and plan
def test_the_qwen3_8b_pair_is_qwen3_8b_and_its_z_lab_drafter(tmp_path):
    target_dir, draft_dir = qwen3_8b_pair(tmp_path)
    target = json.loads((target_dir / "config.json").read_text())
    assert target["architectures"] == ["Qwen3ForCausalLM"] and target["model_type"] == "qwen3"
    assert {k: target[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")} == {
        "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False}
    assert (target["rope_theta"], target["rms_norm_eps"], target["eos_token_id"]) == (1000000, 1e-6, 151645)
    draft = DraftConfig.load(draft_dir)
    assert draft.target_layer_ids == (1, 9, 17, 25, 33) and (draft.mask_token_id, draft.block_size) == (151669, 16)
    assert (draft.num_hidden_layers, draft.hidden_size, draft.intermediate_size, draft.num_target_layers) == (
        5, 4096, 12288, 36)
    assert sorted(p.name for p in target_dir.iterdir()) == ["config.json"]  # (dummy-loaded: no weights travel)


def test_the_tiny_pair_is_the_same_architecture():
    (big_t, big_d), (tiny_t, tiny_d) = qwen3_configs(QWEN3_8B_SHAPE), qwen3_configs(QWEN3_TINY)
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "num_hidden_layers", "max_window_layers", "bos_token_id", "eos_token_id",
             "num_target_layers", "layer_types", "dflash_config")
    for big, tiny in ((big_t, tiny_t), (big_d, tiny_d)):
        assert {k for k in big if k not in sizes} == {k for k in tiny if k not in sizes}
        assert all(big[k] == tiny[k] for k in big if k not in sizes)  # architectures, norms, RoPE, block, ...
    draft = DraftConfig.from_dict(tiny_d)
    assert draft.n_features == 5 and max(draft.target_layer_ids) < tiny_t["num_hidden_layers"]
    assert draft.mask_token_id < tiny_t["vocab_size"] and draft.hidden_size == tiny_t["hidden_size"]
    assert tiny_t["hidden_size"] <= 128 and tiny_t["num_hidden_layers"] <= 8


def test_the_headline_runs_first_on_cuda_and_alone_on_cpu():
    order = [(b.key, arm, tau) for b, arm, tau in cells("cuda")]
    assert order[:4] == [("qwen3-8b", NONE, None), ("qwen3-8b", "ours_controller", 4.0),
                         ("qwen3-8b", "ours_chain", 4.0), ("qwen3-8b", "builtin", 4.0)]
    assert order[4:7] == [("qwen3-8b", arm, 6.0) for arm in ("ours_controller", "ours_chain", "builtin")]
    assert {k for k, _, _ in order[7:]} == {"smollm2-135m"} and order[7][1] == NONE
    cpu = cells("cpu")
    assert [(b.key, arm) for b, arm, _ in cpu] == [("qwen3-tiny", NONE), ("qwen3-tiny", "ours_controller"),
                                                   ("qwen3-tiny", "ours_chain")]
    assert all(b.dummy for b, _, _ in cpu)


def test_dummy_pairs_dummy_load_the_draft_for_every_arm(tmp_path):
    for name, (kw, _) in arms(4.0, "cuda", tmp_path, dummy=True).items():
        assert kw["speculative_draft_load_format"] == "dummy" and kw["speculative_draft_model_path"] == str(tmp_path)
    assert "speculative_draft_load_format" not in arms(4.0, "cuda")["ours_chain"][0]  # (the shipped drafter: loaded)


# ---------------------------------------------------------------------------------------------- the stage's budget
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _fake_engine(clock: Clock, seconds: float, ran: list[str]):
    """run_engine without an Engine: `seconds` on the clock, every request at tau's commit length, ours 2x none."""
    from dflash_sglang.bench.serving.pareto import OURS_LOG_MARKER

    def run(ctx, name, kwargs, env, plan, new_tokens, timeout_s):
        clock.t += seconds
        ran.append(name)
        spec = "speculative_algorithm" in kwargs
        steps = new_tokens // 4 if spec else None
        log = ctx.work / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(OURS_LOG_MARKER)
        rounds = [{"key": s["key"], "pass": 0, "wall_s": (1.0 if spec else 2.0), "cpu_s": 1.0,
                   "ids": [[5] * (new_tokens + 1)] * s["c"], "accept": [4.0 if spec else None] * s["c"],
                   "verify_ct": [steps] * s["c"]} for s in plan if not s.get("warmup")]
        return {"rounds": rounds}, log, 0

    return run


def test_on_cuda_the_headline_is_the_must_part_and_the_rest_leaves_room_for_later_stages(tmp_path, monkeypatch):
    from dflash_sglang.bench.gpu import throughput as gpu_throughput
    from dflash_sglang.bench.gpu.context import Budget, Context

    clock, ran = Clock(), []
    monkeypatch.setattr(gpu_throughput, "run_engine", _fake_engine(clock, 60.0, ran))
    ctx = Context("cuda", tmp_path / "out", tmp_path / "work", Budget(330, clock), reserve_s=160.0)
    table = gpu_throughput.stage_throughput(ctx)
    # tau 4's four Engines run (240 s: the must part ignores the reserve); tau 6 and SmolLM2 would eat it
    assert ran == ["qwen3-8b_none", "qwen3-8b_ours_controller@4", "qwen3-8b_ours_chain@4", "qwen3-8b_builtin@4"]
    by_cell = {(r["target"], r["arm"], r["tau"], r.get("c")): r["verdict"] for r in table.rows}
    assert by_cell[("qwen3-8b", "ours_chain", 4.0, 32)] == "same: 1.00x builtin"  # (the fake's equal walls)
    assert by_cell[("qwen3-8b", "none", None, 1)] == "pass" and by_cell[("qwen3-8b", "builtin", 4.0, 8)] == (
        "pass: 2.00x none")
    assert by_cell[("qwen3-8b", "ours_controller", 6.0, None)].startswith("skipped: budget (needs ~60 s + 220 s kept")
    assert by_cell[("smollm2-135m", "none", None, None)].startswith("skipped: budget")
    assert table.status() == "partial"
    assert any(n.startswith("controller shape mix: skipped: budget") for n in table.notes)
    assert by_cell[("qwen3-8b", "controller probe", 4.0, None)].startswith("skipped: budget")


def test_a_probe_that_logged_nothing_fails_the_stage(tmp_path, monkeypatch):
    """The controller's shape mix is a row with a verdict: a probed Engine without probe lines fails the stage (it
    was a note before, under a stage that read passed)."""
    from dflash_sglang.bench.gpu import throughput as gpu_throughput
    from dflash_sglang.bench.gpu.context import Budget, Context

    clock, ran = Clock(), []
    monkeypatch.setattr(gpu_throughput, "run_engine", _fake_engine(clock, 1.0, ran))
    monkeypatch.setattr(gpu_throughput, "SIZES", {"cuda": gpu_throughput.SIZES["cuda"][:1]})
    ctx = Context("cuda", tmp_path / "out", tmp_path / "work", Budget(10_000, clock))
    table = gpu_throughput.stage_throughput(ctx)
    assert ran[-1] == "qwen3-8b_probe@4"
    probe = next(r for r in table.rows if r["arm"] == "controller probe")
    assert probe["verdict"] == "FAIL: no probe lines (log qwen3-8b_probe@4.log)" and table.status() == "failed"
