"""The pure parts of the Engine throughput benchmark (dflash_sglang/bench/engine.py) and the training-job pause
(bench/quiet.py): arm specs, the plan of generate calls, tokens/s ratios and mismatches vs plain. No Engine starts."""
from __future__ import annotations

import pytest

from dflash_sglang.bench.engine import (
    STATIC_TABLE, build_plan, mismatches, parse_arm, parse_kv, parse_value, plot_switch, summarize, switch_schedule,
)
from dflash_sglang.bench.quiet import busy_share, cpu_model, training_paused

SPEC = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "/d"}


def test_parse_value_and_kv():
    assert [parse_value(v) for v in ("3", "-2", "0.5", "True", "false", "none", "inf:1x1")] == [
        3, -2, 0.5, True, False, None, "inf:1x1"]
    assert parse_kv(["a=1", "b = x=y"]) == {"a": 1, "b": "x=y"}
    with pytest.raises(ValueError):
        parse_kv(["novalue"])


def test_builtin_arms():
    assert parse_arm("plain", "/d") == ("plain", {})
    assert parse_arm("default", "/d") == ("default", SPEC)
    assert parse_arm("chain16", "/d")[1] == {**SPEC, "speculative_num_draft_tokens": 16}
    assert parse_arm("static", "/d")[1] == {**SPEC, "speculative_adaptive": True,
                                            "speculative_dflash_adaptive_table": STATIC_TABLE}
    assert parse_arm("floor", "/d")[1]["speculative_dflash_adaptive_table"] == "inf:1x1"
    assert parse_arm("adaptive", "/d")[1] == {**SPEC, "speculative_adaptive": True}
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arm("chain99", "/d")


def test_custom_arms():
    name, kw = parse_arm("tree:speculative_eagle_topk=4;speculative_num_draft_tokens=32;speculative_adaptive=false",
                         "/d")
    assert name == "tree" and kw == {**SPEC, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 32,
                                     "speculative_adaptive": False}
    # a value `none` drops the key: a plain variant with other Engine kwargs
    assert parse_arm("p2:speculative_algorithm=none;speculative_draft_model_path=none;chunked_prefill_size=64",
                     "/d") == ("p2", {"chunked_prefill_size": 64})
    assert parse_arm("x:", "/d") == ("x", SPEC)


def test_switch_schedule():
    assert switch_schedule("ABA", 2) == [(0, "A"), (1, "A"), (2, "B"), (3, "B"), (4, "A"), (5, "A")]
    assert switch_schedule("AB", 1) == [(0, "A"), (1, "B")]


EVALS = [[i, i] for i in range(10)]
PRED = [[100 + i] for i in range(3)]


def test_eval_plan_takes_distinct_prompts_per_round_and_cycles():
    plan = build_plan("eval", [1, 4], 2, EVALS, PRED)
    assert [s.get("key") for s in plan] == [None, "c1.r0", "c1.r1", None, "c4.r0", "c4.r1"]
    assert plan[0]["warmup"] and plan[0]["ids"] == EVALS[:1] and plan[3]["ids"] == EVALS[:4]
    assert plan[1]["ids"] == [EVALS[0]] and plan[2]["ids"] == [EVALS[1]]
    assert plan[4]["ids"] == EVALS[:4] and plan[5]["ids"] == EVALS[4:8]
    assert build_plan("eval", [4], 3, EVALS, PRED)[-1]["ids"] == [EVALS[8], EVALS[9], EVALS[0], EVALS[1]]
    assert all(s["group"] == f"c={s['c']}" for s in plan if "key" in s)


def test_switch_plan_alternates_pools_and_continues_each():
    plan = build_plan("switch", [2, 8], 1, EVALS, PRED, phases="ABA", phase_rounds=2)
    timed = plan[1:]
    assert plan[0]["warmup"] and [s["phase"] for s in timed] == list("AABBAA")
    assert all(s["c"] == 2 for s in timed) and [s["group"] for s in timed][:3] == ["0:A", "1:A", "2:B"]
    assert [s["ids"] for s in timed] == [EVALS[0:2], EVALS[2:4], PRED[0:2], [PRED[2], PRED[0]], EVALS[4:6],
                                         EVALS[6:8]]


def _res(rounds: dict[str, tuple[float, list[list[int]], list[float | None]]]) -> dict:
    return {"rounds": [{"key": k, "wall_s": w, "ids": ids, "accept": acc, "verify_ct": [None] * len(ids)}
                       for k, (w, ids, acc) in rounds.items()]}


def test_summary_ratio_accept_and_mismatches():
    plan = build_plan("eval", [1, 2], 2, EVALS, PRED)
    plain = _res({"c1.r0": (1.0, [[1, 2]], [None]), "c1.r1": (1.0, [[3, 4]], [None]),
                  "c2.r0": (2.0, [[1], [2]], [None, None]), "c2.r1": (2.0, [[3], [4]], [None, None])})
    spec = _res({"c1.r0": (0.5, [[1, 2]], [2.0]), "c1.r1": (0.5, [[3, 5]], [3.0]),
                 "c2.r0": (4.0, [[1], [2]], [1.0, 1.5]), "c2.r1": (4.0, [[9], [8]], [1.0, 1.0])})
    rows = {(r["arm"], r["group"]): r for r in summarize(plan, {"plain": plain, "spec": spec, "dead": None})}
    assert set(rows) == {("plain", "c=1"), ("plain", "c=2"), ("spec", "c=1"), ("spec", "c=2")}
    assert rows["plain", "c=1"]["tok_s"] == 2.0 and rows["plain", "c=1"]["ratio"] == 1.0
    assert rows["plain", "c=1"]["mismatches"] == 0 and rows["plain", "c=1"]["accept_mean"] is None
    s1, s2 = rows["spec", "c=1"], rows["spec", "c=2"]
    assert (s1["tokens"], s1["tok_s"], s1["ratio"], s1["accept_mean"], s1["mismatches"]) == (4, 4.0, 2.0, 2.5, 1)
    assert (s2["tok_s"], s2["ratio"], s2["accept_mean"], s2["mismatches"]) == (0.5, 0.5, 1.125, 2)
    # no plain arm: no ratio, no mismatch count
    alone = summarize(plan, {"spec": spec})
    assert all(r["ratio"] is None and r["mismatches"] is None for r in alone)
    assert mismatches(spec, None, ["c1.r0"]) is None and mismatches(spec, plain, ["c1.r1", "c2.r1"]) == 3


def test_training_paused_calls_the_job_script(tmp_path):
    calls = tmp_path / "calls"
    script = tmp_path / "job.sh"
    script.write_text(f'echo "$1" >> {calls}; echo "train_job: $1"\n')
    with training_paused(script) as job:
        assert job.paused
        job.pause()
    assert calls.read_text().split() == ["pause", "pause", "resume"]
    calls.unlink()
    with pytest.raises(KeyboardInterrupt), training_paused(script):
        raise KeyboardInterrupt
    assert calls.read_text().split() == ["pause", "resume"]
    with training_paused(tmp_path / "missing.sh") as job:
        assert not job.paused


def test_training_not_running_is_not_resumed(tmp_path):
    calls = tmp_path / "calls"
    script = tmp_path / "job.sh"
    script.write_text(f'echo "$1" >> {calls}; echo "train_job: not running"\n')
    with training_paused(script) as job:
        assert not job.paused
    assert calls.read_text().split() == ["pause"]


def test_busy_share_is_a_share():
    share = busy_share(0.05)
    assert share is None or 0.0 <= share <= 1.0


def test_machine_facts():
    model = cpu_model()
    assert model is None or (isinstance(model, str) and model)


def test_switch_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"arm": arm, "phase": ph, "tok_s": t} for arm in ("plain", "static") for ph, t in zip("AABA", (3, 4, 9, 3))]
    assert plot_switch(rows, tmp_path / "s.png") == str(tmp_path / "s.png") and (tmp_path / "s.png").stat().st_size


def test_shape_trace_assigns_steps_to_the_round_that_follows_them(tmp_path):
    from dflash_sglang.bench.shape_trace import TracedStep, parse_trace, plot_trace

    log = "\n".join([
        "DFLASH goodput step: shape=16 bs=1 accepted=3 seconds=0.2",  # the warm-up's: dropped
        "[default] warmup c=1 1.50s",
        "x DFLASH goodput step: shape=1 bs=2 accepted=0 seconds=None",
        "[default] s0 c=1 7.93s",
        "DFLASH goodput step: shape=8x4 bs=2 accepted=9 seconds=0.15",
        "[default] s1 c=1 4.20s",
        "DFLASH goodput step: shape=1 bs=1 accepted=0 seconds=0.08",  # after the last round: dropped
    ])
    steps = parse_trace(log)
    assert steps == [TracedStep(1, 1.0, 0), TracedStep(8, 5.5, 1, topk=4)]
    pytest.importorskip("matplotlib")
    assert plot_trace(steps, ["A", "B"], tmp_path / "t.png") == str(tmp_path / "t.png")
