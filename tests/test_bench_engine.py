"""The pure parts of the Engine throughput benchmark (dflash_sglang/measure/passes.py) and the training-job pause
(measure/training_pause.py): arm specs, the plan of generate calls (repeats interleaved as passes over the arms),
tokens/s ratios with their interval and wording, and mismatches vs plain. No Engine starts, nothing is timed."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from dflash_sglang.bench.engine.compare import STATIC_TABLE, parse_arm, plot_switch
from dflash_sglang.measure.passes import (
    build_plan, mismatches, parse_kv, parse_value, split_env, summarize, switch_schedule,
)
from dflash_sglang.measure.spread import FASTER, ONE_REPEAT, SAME, SLOWER, RatioSpread
from dflash_sglang.measure.training_pause import SCRIPT, busy_share, cpu_model, training_paused

REPO = Path(__file__).resolve().parents[1]
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
    # env.NAME=value: that arm's child environment, as written, apart from its Engine kwargs
    name, kw = parse_arm("eager:speculative_adaptive=true;env.DFLASH_DEFER_PLAIN_UPKEEP=0;env.X=true", "/d")
    assert split_env(kw) == ({**SPEC, "speculative_adaptive": True}, {"DFLASH_DEFER_PLAIN_UPKEEP": "0", "X": "true"})
    assert split_env(parse_arm("default", "/d")[1]) == (SPEC, {})
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_arm("x:env.NOVALUE", "/d")


def test_switch_schedule():
    assert switch_schedule("ABA", 2) == [(0, "A"), (1, "A"), (2, "B"), (3, "B"), (4, "A"), (5, "A")]
    assert switch_schedule("AB", 1) == [(0, "A"), (1, "B")]


EVALS = [[i, i] for i in range(10)]
PRED = [[100 + i] for i in range(3)]


def test_eval_plan_takes_distinct_prompts_per_round_and_cycles():
    plan = build_plan("eval", [1, 4], 2, EVALS, PRED)
    # repeat r is pass r: every concurrency's warm-up and round r, in one Engine per arm
    assert [(s["pass"], s.get("key")) for s in plan] == [(0, None), (0, "c1.r0"), (0, None), (0, "c4.r0"),
                                                         (1, None), (1, "c1.r1"), (1, None), (1, "c4.r1")]
    assert plan[0]["warmup"] and plan[0]["ids"] == EVALS[:1] and plan[2]["ids"] == EVALS[:4]
    assert plan[4]["ids"] == plan[0]["ids"]  # each pass's fresh Engine warms up the same way
    assert plan[1]["ids"] == [EVALS[0]] and plan[5]["ids"] == [EVALS[1]]
    assert plan[3]["ids"] == EVALS[:4] and plan[7]["ids"] == EVALS[4:8]
    assert build_plan("eval", [4], 3, EVALS, PRED)[-1]["ids"] == [EVALS[8], EVALS[9], EVALS[0], EVALS[1]]
    assert all(s["group"] == f"c={s['c']}" for s in plan if "key" in s)


def test_switch_plan_alternates_pools_and_continues_each():
    plan = build_plan("switch", [2, 8], 1, EVALS, PRED, phases="ABA", phase_rounds=2)
    timed = plan[1:]
    assert plan[0]["warmup"] and [s["phase"] for s in timed] == list("AABBAA")
    assert all(s["c"] == 2 for s in timed) and [s["group"] for s in timed][:3] == ["0:A", "1:A", "2:B"]
    assert [s["ids"] for s in timed] == [EVALS[0:2], EVALS[2:4], PRED[0:2], [PRED[2], PRED[0]], EVALS[4:6],
                                         EVALS[6:8]]
    twice = build_plan("switch", [2], 2, EVALS, PRED, phases="ABA", phase_rounds=2)
    # every pass the same stream (its keys again, told apart by the pass), after its own warm-up
    assert [(s["pass"], s.get("key")) for s in twice] == [(k, key) for k in (0, 1) for key in
                                                          (None, "s0", "s1", "s2", "s3", "s4", "s5")]
    assert [s["ids"] for s in twice[7:]] == [s["ids"] for s in plan]


def _res(rounds: dict[str, tuple[float, list[list[int]], list[float | None]]]) -> dict:
    """A child's result: eval round `c<c>.r<r>` ran in pass r."""
    return {"rounds": [{"key": k, "pass": int(k.rsplit(".r", 1)[1]), "wall_s": w, "ids": ids, "accept": acc,
                        "verify_ct": [None] * len(ids)} for k, (w, ids, acc) in rounds.items()]}


def test_summary_ratio_accept_and_mismatches():
    plan = build_plan("eval", [1, 2], 2, EVALS, PRED)
    plain = _res({"c1.r0": (1.0, [[1, 2]], [None]), "c1.r1": (1.0, [[3, 4]], [None]),
                  "c2.r0": (2.0, [[1], [2]], [None, None]), "c2.r1": (2.0, [[3], [4]], [None, None])})
    spec = _res({"c1.r0": (0.5, [[1, 2]], [2.0]), "c1.r1": (0.5, [[3, 5]], [3.0]),
                 "c2.r0": (4.0, [[1], [2]], [1.0, 1.5]), "c2.r1": (4.0, [[9], [8]], [1.0, 1.0])})
    rows = {(r["arm"], r["group"]): r for r in summarize(plan, {"plain": plain, "spec": spec, "dead": None})}
    assert set(rows) == {("plain", "c=1"), ("plain", "c=2"), ("spec", "c=1"), ("spec", "c=2")}
    assert rows["plain", "c=1"]["tok_s"] == 2.0 and rows["plain", "c=1"]["ratio"] == 1.0
    assert rows["plain", "c=1"]["verdict"] is rows["plain", "c=1"]["ratio_ci95"] is None  # (not compared with itself)
    assert rows["plain", "c=1"]["mismatches"] == 0 and rows["plain", "c=1"]["accept_mean"] is None
    s1, s2 = rows["spec", "c=1"], rows["spec", "c=2"]
    assert (s1["tokens"], s1["tok_s"], s1["ratio"], s1["accept_mean"], s1["mismatches"]) == (4, 4.0, 2.0, 2.5, 1)
    assert (s2["tok_s"], s2["ratio"], s2["accept_mean"], s2["mismatches"]) == (0.5, 0.5, 1.125, 2)
    # the same ratio in both repeats: a zero-width interval away from 1.0
    assert (s1["repeats"], s1["ratio_ci95"], s1["verdict"]) == (2, [2.0, 2.0], FASTER)
    assert (s2["ratio_min"], s2["ratio_max"], s2["verdict"]) == (0.5, 0.5, SLOWER)
    # no plain arm: no ratio, no verdict, no mismatch count
    alone = summarize(plan, {"spec": spec})
    assert all(r["ratio"] is None and r["verdict"] is None and r["mismatches"] is None for r in alone)
    assert mismatches(spec, None, [(0, "c1.r0")]) is None
    assert mismatches(spec, plain, [(1, "c1.r1"), (1, "c2.r1")]) == 3
    assert mismatches(spec, plain, [(0, "c1.r1")]) == 0  # (no such round: c1.r1 ran in pass 1)


def test_summary_pairs_each_repeat_with_plains_and_words_noise_as_noise():
    """Made-up timings: an arm whose per-repeat ratios to plain straddle 1.0 (1.09x, then 0.85x: the issue's two
    runs) is the same as plain within noise, never a speedup or slower; one repeat gives no interval and no verdict
    word; the ratio pairs each repeat with plain's, so a slow repeat for both cancels."""
    plan = build_plan("eval", [1], 2, EVALS, PRED)
    plain = _res({"c1.r0": (1.0, [[1] * 10], [None]), "c1.r1": (2.0, [[1] * 10], [None])})  # the machine slowed
    noisy = _res({"c1.r0": (1.0 / 1.09, [[1] * 10], [1.0]), "c1.r1": (2.0 / 0.85, [[1] * 10], [1.0])})
    steady = _res({"c1.r0": (0.8, [[1] * 10], [1.5]), "c1.r1": (1.6, [[1] * 10], [1.5])})  # 1.25x in both
    rows = {r["arm"]: r for r in summarize(plan, {"plain": plain, "noisy": noisy, "steady": steady})}
    assert rows["noisy"]["verdict"] == SAME and rows["noisy"]["ratio"] == pytest.approx(0.97)
    lo, hi = rows["noisy"]["ratio_ci95"]
    assert lo < 1.0 < hi and (rows["noisy"]["ratio_min"], rows["noisy"]["ratio_max"]) == (0.85, 1.09)
    assert rows["steady"]["verdict"] == FASTER and rows["steady"]["ratio_ci95"] == [1.25, 1.25]
    one = summarize(build_plan("eval", [1], 1, EVALS, PRED), {"plain": plain, "steady": steady})
    assert [(r["arm"], r["repeats"], r["ratio_ci95"], r["verdict"]) for r in one] == [
        ("plain", 1, None, None), ("steady", 1, None, ONE_REPEAT)]


@pytest.mark.parametrize("arm,base,verdict", [
    ([13.0, 13.4, 12.9, 13.1, 13.3], [10.0, 10.5, 9.8, 10.2, 10.1], FASTER),
    ([7.0, 7.2, 6.9], [10.0, 10.1, 9.9], SLOWER),
    ([10.9, 8.5], [10.0, 10.0], SAME),  # the 1.09x and 0.85x
    ([27.0, 21.0, 28.0, 23.0, 29.0, 22.0], [25.0, 22.0, 26.0, 24.0, 27.0, 23.0], SAME),  # median above 1, noise
    ([10.0, 10.0, 10.0], [10.0, 10.0, 10.0], SAME),  # identical: a zero-width interval at 1.0
    ([12.0], [10.0], ONE_REPEAT),
], ids=["faster", "slower", "issue", "noisy-median-above", "identical", "one-repeat"])
def test_ratio_is_a_speedup_or_slower_only_when_its_interval_excludes_one(arm, base, verdict):
    spread = RatioSpread.paired(arm, base)
    assert spread.verdict == verdict
    text = spread.words()
    ci = spread.interval
    assert ("speedup" in text) == (verdict == FASTER) and ("slower" in text) == (verdict == SLOWER), text
    if verdict == ONE_REPEAT:
        assert ci is None and text.endswith("x from one repeat: no interval, so no verdict on speed"), text
        return
    lo, hi = ci
    assert lo <= spread.median <= hi or verdict == SAME
    assert (verdict == FASTER) == (lo > 1.0) and (verdict == SLOWER) == (hi < 1.0)
    assert text.startswith({FASTER: "speedup ", SLOWER: "slower than plain: ", SAME: f"{SAME}: "}[verdict]), text
    assert f"(95% interval {lo:.2f}-{hi:.2f}x, per repeat {min(spread.ratios):.2f}-{max(spread.ratios):.2f}x, " \
           f"{len(arm)} interleaved repeats)" in text, text


def test_repeats_run_as_passes_over_the_arms(monkeypatch):
    """Interleaving: every repeat runs each arm's Engine in turn (plain, spec, bad, plain, spec, ...), one at a
    time, on that pass's steps only; an arm that fails is not run again and has no result."""
    import contextlib
    from types import SimpleNamespace

    from dflash_sglang.measure import passes as engine
    calls = []

    def fake_run_arm(name, kwargs, steps, args, common, stem=None):
        calls.append((stem, sorted({s["pass"] for s in steps})))
        if name == "bad" and steps[0]["pass"] == 1:
            return None
        return {"startup_s": 1.0, "rounds": [{"key": s["key"], "pass": s["pass"], "wall_s": 1.0, "ids": [[1]],
                                              "accept": [None], "verify_ct": [None]}
                                             for s in steps if not s.get("warmup")]}

    monkeypatch.setattr(engine, "run_arm", fake_run_arm)
    monkeypatch.setattr(engine, "busy_share", lambda seconds: 0.0)
    monkeypatch.setattr(engine, "training_paused", lambda: contextlib.nullcontext(SimpleNamespace(pause=lambda: None)))
    plan = build_plan("eval", [1, 2], 3, EVALS, PRED)
    results, info = engine.run_passes({"plain": {}, "spec": SPEC, "bad": SPEC}, plan,
                                      SimpleNamespace(repeats=3, out=Path("out")), {})
    assert calls == [("plain.p0", [0]), ("spec.p0", [0]), ("bad.p0", [0]), ("plain.p1", [1]), ("spec.p1", [1]),
                     ("bad.p1", [1]), ("plain.p2", [2]), ("spec.p2", [2])]
    assert results["bad"] is None and [p["failed"] for p in info["bad"]["passes"]] == [False, True]
    assert [(r["pass"], r["key"]) for r in results["spec"]["rounds"]] == [
        (k, f"c{c}.r{k}") for k in range(3) for c in (1, 2)]
    rows = summarize(plan, results)
    assert {(r["arm"], r["repeats"], r["verdict"]) for r in rows if r["arm"] == "spec"} == {("spec", 3, SAME)}
    # --baseline: the ratios over another arm, its name in the verdict; the baseline itself has none
    rows = summarize(plan, results, baseline="spec")
    assert {(r["arm"], r["verdict"]) for r in rows if r["arm"] != "bad"} == {
        ("plain", "same as spec within noise"), ("spec", None)}


FAKE_RESIDENT_CHILD = """
import json, os, sys
from dflash_sglang.measure import resident
job = json.load(open(sys.argv[1]))
def run_pass(k):
    if job["arm"] == "bad" and k == 1:
        sys.exit(3)  # dies mid-run: the parent must say so and carry on without it
    return [{"key": s["key"], "pass": k, "wall_s": 1.0 + k, "ids": [[1]],
             "accept": [None], "verify_ct": [None]} for s in job["plan"] if s["pass"] == k and not s.get("warmup")]
assert job["resident"] and job["engine_kwargs"]["sleep_on_idle"] is True
with os.fdopen(job["answer_fd"], "w") as answer:
    resident.serve_commands(run_pass, sys.stdin, answer, startup_s=2.5)
"""


def test_resident_engines_start_once_and_serve_every_pass_in_alternating_order(tmp_path):
    """--resident: one child per arm, started one after another (each answers `ready` first), SGLang's
    sleep_on_idle on; pass k asks the arms in turn, reversed on odd passes; a child that dies is reported failed and
    not asked again; every child is gone afterwards; the results merge like run_passes'."""
    import sys
    from types import SimpleNamespace

    from dflash_sglang.measure import resident
    children, order = [], []

    def spawn(name, kwargs, stem):
        job = {"arm": name, "plan": plan, "engine_kwargs": kwargs}
        return resident.ChildSpec([sys.executable, "-c", FAKE_RESIDENT_CHILD, str(tmp_path / f"{stem}.job.json")],
                                  job, tmp_path / f"{stem}.job.json", {**os.environ, "PYTHONPATH": str(REPO)},
                                  tmp_path / f"{stem}.log", REPO)

    real_start = resident.ResidentChild.start

    def start(name, spec, timeout):
        children.append(real_start(name, spec, timeout))
        return children[-1]

    plan = build_plan("eval", [1, 2], 3, EVALS, PRED)
    args = SimpleNamespace(repeats=3, out=tmp_path, child_timeout=60.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(resident.ResidentChild, "start", staticmethod(start))
        results, info = resident.run_resident(
            {"plain": {}, "spec": SPEC, "bad": SPEC}, plan, args, spawn, lambda seconds: 0.0,
            SimpleNamespace(pause=lambda: None), 0.0, lambda line: None, lambda name, seen: order.append(
                (name, seen["pass"], seen["failed"])))
    assert order == [("plain", 0, False), ("spec", 0, False), ("bad", 0, False),
                     ("bad", 1, True), ("spec", 1, False), ("plain", 1, False),
                     ("plain", 2, False), ("spec", 2, False)]
    assert all(c.proc.poll() is not None for c in children) and len(children) == 3
    assert results["bad"] is None and results["spec"] is not None
    assert [(r["pass"], r["key"]) for r in results["spec"]["rounds"]] == [
        (k, f"c{c}.r{k}") for k in range(3) for c in (1, 2)]
    assert [p["startup_s"] for p in info["spec"]["passes"]] == [2.5, None, None]
    assert info["spec"]["resident"] and info["spec"]["passes"][0]["log"] == str(tmp_path / "spec.resident.log")
    rows = summarize(plan, results)
    assert {(r["arm"], r["repeats"]) for r in rows if r["arm"] == "spec"} == {("spec", 3)}


@pytest.mark.parametrize("arm,base,head", [
    ([7.0, 7.2, 6.9], [10.0, 10.1, 9.9], "slower than whole: "),
    ([10.9, 8.5], [10.0, 10.0], "same as whole within noise: "),
    ([13.0, 13.4, 12.9], [10.0, 10.5, 9.8], "speedup "),
])
def test_ratio_words_name_the_baseline_arm(arm, base, head):
    """A ratio over another arm than plain (bench/serving/pd.py's is over the whole server) is worded over that arm."""
    text = RatioSpread.paired(arm, base, baseline="whole").words()
    assert text.startswith(head) and "plain" not in text, text


def test_ratio_spread_refuses_unpaired_speeds():
    with pytest.raises(ValueError, match="same number"):
        RatioSpread.paired([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="> 0"):
        RatioSpread.paired([0.0], [1.0])


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


def _job_script(tmp_path, says: str):
    """A stand-in train_job.sh that records its actions in `calls` and answers every one with `says`."""
    calls, script = tmp_path / "calls", tmp_path / "job.sh"
    script.write_text(f'echo "$1" >> {calls}; echo "{says}"\n')
    return script, calls


def test_training_not_running_is_not_resumed(tmp_path):
    script, calls = _job_script(tmp_path, "train_job: not running")
    with training_paused(script) as job:
        assert not job.paused
    assert calls.read_text().split() == ["pause"]


def test_training_paused_by_someone_else_is_not_resumed(tmp_path):
    script, calls = _job_script(tmp_path, "train_job: already paused (pid 1)")
    with training_paused(script) as job:
        assert not job.paused
        assert not job.pause()
    assert calls.read_text().split() == ["pause", "pause"]


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_train_job_script_leaves_a_hand_paused_job_paused(tmp_path, monkeypatch):
    """scripts/train_job.sh itself, on a stand-in job (a sleeping process group): a benchmark that pauses the running
    job resumes it on exit, a repeated pause included; one that finds it paused by hand leaves it paused."""
    monkeypatch.setenv("DFLASH_TRAIN_JOB_DIR", str(tmp_path))
    job = subprocess.Popen(["sleep", "300"], start_new_session=True)

    def stopped(want: bool) -> bool:  # (a signal is delivered asynchronously: wait a little for the state)
        for _ in range(100):
            if (Path(f"/proc/{job.pid}/stat").read_text().split()[2] == "T") == want:
                return True
            time.sleep(0.02)
        return False

    try:
        (tmp_path / "job.pid").write_text(str(job.pid))
        with training_paused() as pause:
            assert pause.paused and stopped(True)
            assert pause.pause() and stopped(True)  # "already paused": by us, so still ours to resume
        assert stopped(False)
        assert "pause (SIGSTOP" in subprocess.run(["bash", str(SCRIPT), "pause"], capture_output=True, text=True,
                                                  check=True).stdout  # by hand
        with training_paused() as pause:
            assert not pause.paused and stopped(True)
        assert stopped(True)  # left as found
        assert "paused" in subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True).stdout
    finally:
        job.kill()
        job.wait()


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
    from dflash_sglang.measure.shape_trace import TracedStep, parse_trace, plot_trace

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


def test_step_profile_places_each_scheduler_sample_in_its_first_part():
    """py-spy's raw stacks summed by part of the step (measure/step_profile.py): the scheduler's event loop only
    (not its start-up, not other processes), the first part a stack names wins (a catch-up's commit is upkeep, not the
    worker's rest), per timed output token."""
    from dflash_sglang.measure import step_profile
    sched = ("<module> (<string>:1);run_scheduler_process (scheduler.py:1);Scheduler.event_loop_normal (s.py:2);"
             "Scheduler.run_batch (scheduler.py:3)")
    worker = f"{sched};DFlashWorker._decode (dflash_sglang/adapter/step/worker.py:3)"
    raw = "\n".join([
        f"{worker};DeferredPlainCommit.catch_up (dflash_sglang/adapter/step/upkeep.py:4);PagedDrafter.commit (m.py:5) "
        "30",
        f"{worker};run_target_verify (dflash_sglang/adapter/step/verify.py:6);ModelRunner.forward (mr.py:7) 500",
        f"{worker};DFlashWorker._draft_pass (dflash_sglang/adapter/step/worker.py:8) 20",
        f"{worker};DFlashWorker._choose_shape (dflash_sglang/adapter/step/worker.py:9) 7",
        f"{sched};Scheduler.get_next_batch_to_run (scheduler.py:10) 40",
        "<module> (<string>:1);TokenizerManager.handle_loop (tokenizer_manager.py:1) 999",
        "<module> (<string>:1);run_scheduler_process (scheduler.py:1);Scheduler.__init__ (scheduler.py:4) 999",
        "not a stack line",
    ])
    counts = step_profile.parts(raw)
    assert counts == {"draft K/V upkeep": 30, "target forward": 500, "drafter pass": 20, "our worker, rest": 7,
                      "SGLang scheduler, rest": 40}
    row = step_profile.ms_per_token(raw, tokens=100)  # 10 ms a sample at 100 Hz, over 100 tokens
    assert list(row) == [name for name, _ in step_profile.PARTS] + ["all"]
    assert row["target forward"] == 50.0 and row["draft K/V upkeep"] == 3.0 and row["all"] == 59.7
    cmd = step_profile.command(Path("/o/x.pyspy.txt"), ["python", "-m", "m"])
    assert cmd[:2] == ["py-spy", "record"] and "--subprocesses" in cmd and cmd[-4:] == ["--", "python", "-m", "m"]
