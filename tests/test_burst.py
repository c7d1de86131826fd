"""The mixed-burst benchmark (scripts/bench_burst.py, dflash_sglang/bench/serving/burst.py).

Without SGLang: the arms' launch flags, the burst's make-up (ordinary requests only, seeded), the greedy comparison
and the report's ratios and words. With SGLang and the SmolLM2 testbed: a small real run (plain and the DFLASH
default, two interleaved repeats) must answer every request, equal plain on every greedy one, and write its result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_support import sglang_skip_reason

from dflash_sglang.bench.serving import burst
from dflash_sglang.bench.soak.client import Answer, Outcome
from dflash_sglang.bench.soak.workload import PromptPool

ROOT = Path(__file__).resolve().parents[1]
DRAFT = Path("/draft")


def test_arms_launch_plain_the_overlap_off_or_dflash_with_their_flags():
    assert burst.parse_arm("plain", DRAFT).flags == []
    assert burst.parse_arm("plain-sync", DRAFT).flags == ["--disable-overlap-schedule"]
    default = burst.parse_arm("default", DRAFT).flags
    assert default == ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/draft"]
    assert burst.parse_arm("floor", DRAFT).flags[-3:] == ["--speculative-adaptive",
                                                          "--speculative-dflash-adaptive-table", "inf:1x1"]
    custom = burst.parse_arm("c48=--max-running-requests 48", DRAFT)
    assert custom.name == "c48" and custom.flags == [*default, "--max-running-requests", "48"]  # DFLASH plus them
    with pytest.raises(SystemExit, match="unknown arm 'fast'"):
        burst.parse_arm("fast", DRAFT)


def _pool() -> PromptPool:
    ids = tuple(tuple(range(10 + i, 60 + i)) for i in range(20))
    return PromptPool(ids, tuple(f"question {i}?" for i in range(20)), 1000, (13,))


def test_a_burst_is_seeded_ordinary_requests():
    a, b = burst.burst(_pool(), 60, 3, 16, 40), burst.burst(_pool(), 60, 3, 16, 40)
    assert a == b and a != burst.burst(_pool(), 60, 4, 16, 40)
    assert len({c.id for c in a}) == 60
    assert all(c.expect == "ok" and not c.action and c.plain for c in a)  # no aborts, no bad requests
    kinds = {c.kind for c in a}
    assert {"greedy", "sampled", "chat_greedy"} <= kinds and any(c.stream for c in a)
    assert any(c.choices > 1 for c in a) and any(c.compare for c in a) and not all(c.compare for c in a)
    assert all(1 <= c.max_tokens <= 16 for c in a)


def test_greedy_answers_and_the_report():
    cases = burst.burst(_pool(), 30, 1, 8, 40)
    outs = [Outcome(c.id, 200, [Answer(ids=[c.id, 1])] * c.choices) for c in cases]
    got = burst.greedy_answers(cases, outs)
    assert set(got) == {c.id for c in cases if c.compare}
    plain, fast = burst.Arm("plain", []), burst.Arm("default", [])
    plain.seconds[8], fast.seconds[8] = [10.0, 11.0, 10.5], [5.0, 5.6, 5.1]
    fast.mismatches[8] = 0
    rows = burst.report([plain, fast], [8])
    assert rows[0]["median_s"] == 10.5 and "ratio" not in rows[0]
    assert rows[1]["ratio"] == pytest.approx(2.0, abs=0.05) and rows[1]["words"].startswith("speedup")
    fast.seconds[8] = [10.0, 11.5, 10.0]  # the same within noise: never called a speedup or slower
    assert burst.report([plain, fast], [8])[1]["words"].startswith("same as plain within noise")


def test_the_baseline_arm_comes_first():
    with pytest.raises(SystemExit, match="must start with plain"):
        burst.main(["--arms", "default,plain", "--target", "/t", "--draft", "/d"])


@pytest.mark.slow
@pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))
def test_small_burst_run(tmp_path):
    """Plain and the DFLASH default (the goodput controller) on 12 mixed requests, two interleaved repeats: every
    request answered, every greedy answer equal to plain's, a ratio per repeat."""
    try:
        from dflash_sglang.testbed import default_pair
        from dflash_sglang.testbed.data import dataset_file

        default_pair(), dataset_file()
    except Exception as e:  # TestbedUnavailable, FileNotFoundError: the packages are not installed
        pytest.skip(f"the SmolLM2 testbed is unavailable: {e}")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_burst.py"), "--arms", "plain,default", "--concurrency", "12",
           "--repeats", "2", "--max-new-tokens", "8", "--max-prompt-tokens", "64", "--max-total-tokens", "8192",
           "--request-timeout", "600", "--out", str(tmp_path)]
    proc = subprocess.run(["nice", *cmd], cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True,
                          timeout=1200)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1])
    assert res == json.loads((tmp_path / "result.json").read_text())
    rows = {r["arm"]: r for r in res["rows"]}
    assert all(len(r["seconds"]) == 2 and r["errors"] == 0 and r["mismatches"] == 0 for r in rows.values()), rows
    assert rows["default"]["ratio"] > 0 and rows["default"]["interval"] is not None
