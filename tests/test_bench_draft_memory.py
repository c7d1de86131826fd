"""scripts/bench_draft_memory.py (dflash_sglang/bench/memory/draft_memory.py): the budget arithmetic, the timed command
it prints, and tiny runs of both modes on the SmolLM2 testbed pair (not performance claims)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_sglang.bench.memory.draft_memory import (budget_rows, engine_command, kv_bytes_per_token,
                                                     multi_turn_prompts, reference_tau, window_tau)
from dflash_sglang.bench.engine.compare import parse_arm
from factories import draft_config_for, mixed_prompts, tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]


def test_budget_rows_divide_the_budget_by_target_plus_draft_bytes():
    target = kv_bytes_per_token(30, 3, 64, 4)
    assert target == 2 * 30 * 3 * 64 * 4
    rows = budget_rows(10_000_000, target, {"auto": 3072, "fp8_e4m3": 768}, request_tokens=320)
    auto, fp8 = rows
    assert auto.max_total_tokens == 10_000_000 // (target + 3072) and auto.bytes_per_token == target + 3072
    assert fp8.max_total_tokens == 10_000_000 // (target + 768) > auto.max_total_tokens
    assert (auto.largest_batch, fp8.largest_batch) == (auto.max_total_tokens // 320, fp8.max_total_tokens // 320)


def test_engine_command_runs_each_option_at_its_capacity():
    rows = budget_rows(50_000_000, 46080, {"auto": 3072, "fp8_e5m2": 768}, request_tokens=320)
    cmd = engine_command(rows, new_tokens=64, repeats=2)
    arms = cmd[cmd.index("--arms") + 1].split(",")
    assert arms[0] == "plain" and len(arms) == 3
    name, kw = parse_arm(arms[2], "/draft")  # bench_engine.py's own parsing of the arm
    assert name == "kv_fp8_e5m2" and kw["speculative_algorithm"] == "DFLASH"
    assert kw["speculative_draft_kv_cache_dtype"] == "fp8_e5m2"
    assert (kw["max_total_tokens"], kw["max_running_requests"]) == (rows[1].max_total_tokens, rows[1].largest_batch)
    assert "speculative_draft_kv_cache_dtype" not in parse_arm(arms[1], "/draft")[1]  # auto: the model dtype
    assert cmd[cmd.index("--concurrency") + 1] == str(max(r.largest_batch for r in rows))


def test_a_window_option_pays_its_rings_per_request_slot():
    """A draft window W: 0 draft B/token; b requests need b + 1 request slots' rings beside their target KV, the rest
    of the budget is target tokens. Its Engine arm runs at that capacity with the window and no radix cache."""
    target, request, ring = 46080, 320, 20 * 3072
    budget = 50_000_000
    rows = budget_rows(budget, target, {"auto": 3072}, request, windows={16: ring})
    auto, window = rows
    assert (window.draft_kv, window.window, window.draft_bytes_per_token, window.draft_bytes_per_request) == (
        "window16", 16, 0, ring)
    b = window.largest_batch
    assert b * request * target + (b + 1) * ring <= budget < (b + 1) * request * target + (b + 2) * ring
    assert window.max_total_tokens == (budget - (b + 1) * ring) // target >= b * request
    assert window.largest_batch >= auto.largest_batch  # (short requests: the rings cost about what the rows do)
    cmd = engine_command(rows, 64, 1)
    name, kw = parse_arm(cmd[cmd.index("--arms") + 1].split(",")[2], "/draft")
    assert name == "kv_window16" and kw["speculative_draft_window_size"] == 16 and kw["disable_radix_cache"] is True
    assert (kw["max_total_tokens"], kw["max_running_requests"]) == (window.max_total_tokens, b)


def test_reference_tau_reports_every_arm_lossless():
    target = tiny_target("llama", vocab=96, seed=3)
    drafter = tiny_drafter(draft_config_for(target, block_size=4))
    res = reference_tau(target, drafter, mixed_prompts(96), 12, 4, ("auto", "fp8_e4m3"))
    assert set(res) == {"auto", "fp8_e4m3"} and all(r["lossless"] for r in res.values())
    assert all(r["tau"] >= 1.0 and r["steps"] > 0 for r in res.values())
    assert drafter.kv_format is None  # restored


def test_window_tau_reports_every_window_lossless():
    target = tiny_target("llama", vocab=96, seed=3)
    drafter = tiny_drafter(draft_config_for(target, block_size=4))
    prompts = mixed_prompts(96, lengths=(12, 20, 9))
    res = window_tau(target, drafter, prompts, 10, 4, (2, None))
    assert set(res) == {"2", "full"} and all(r["lossless"] and r["tau"] >= 1.0 for r in res.values())
    assert all(len(r["prompt_tau"]) == len(prompts) for r in res.values())  # (each prompt's, for the paired ratio)
    assert drafter.context_window is None  # restored


def test_multi_turn_prompts_keep_earlier_turns_and_end_at_a_human_turn():
    from types import SimpleNamespace

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            assert add_generation_prompt and messages[-1]["role"] == "user"
            return {"input_ids": [len(m["content"]) for m in messages]}

    convs = [SimpleNamespace(turns=(("human", "a"), ("gpt", "b"))),  # one exchange: no earlier turn
             SimpleNamespace(turns=(("human", "aa"), ("gpt", "bbb"), ("human", "c"), ("gpt", "dd"))),
             SimpleNamespace(turns=(("human", "x"), ("gpt", "y"), ("human", "z"), ("gpt", "w"), ("human", "v")))]
    assert multi_turn_prompts(Tok(), convs, 5, 3, 5) == [[2, 3, 1], [1, 1, 1, 1, 1]]
    assert multi_turn_prompts(Tok(), convs, 1, 3, 5) == [[2, 3, 1]]
    assert multi_turn_prompts(Tok(), convs, 5, 4, 5) == [[1, 1, 1, 1, 1]]


@pytest.fixture(scope="module")
def pair():
    from dflash_sglang.testbed import TestbedUnavailable, default_pair

    try:
        return default_pair()
    except (TestbedUnavailable, FileNotFoundError) as e:
        pytest.skip(f"testbed pair unavailable: {e}")


@pytest.mark.parametrize("args", [["plan", "--budget-mib", "16", "--windows", "64"],
                                  ["tau", "--prompts", "2", "--new-tokens", "6", "--dtypes", "auto,fp8_e4m3"]],
                         ids=["plan", "tau"])
def test_script_tiny_run(pair, args):
    proc = subprocess.run(["nice", sys.executable, str(ROOT / "scripts" / "bench_draft_memory.py"), *args], cwd=ROOT,
                          env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if args[0] == "plan":
        rows = {r["draft_kv"]: r for r in res["rows"]}
        assert rows["fp8_e4m3"]["draft_bytes_per_token"] * 4 == rows["auto"]["draft_bytes_per_token"]  # fp32 model
        assert rows["fp8_e4m3"]["max_total_tokens"] >= rows["auto"]["max_total_tokens"]
        assert "scripts/bench_engine.py" in res["command"][1]
        assert rows["window64"]["draft_bytes_per_token"] == 0 and rows["window64"]["draft_bytes_per_request"] > 0
    else:
        assert set(res["arms"]) == {"auto", "fp8_e4m3"} and all(a["lossless"] for a in res["arms"].values())



def test_capacity_rows_per_layout():
    """Per-token layouts (no window, a window over the slot rows, the builtin's) hold budget // (target + draft) tokens;
    the ring holds the most requests whose rings (one more request slot) and target KV fit."""
    from dflash_sglang.bench.memory.window_capacity import capacity_rows

    rows = {r.layout: r for r in capacity_rows(10**9, 1000, 100, [4096], [64], 16)}
    assert set(rows) == {"whole", "slots64", "builtin64", "ring64"}
    assert rows["whole"] == rows["slots64"].__class__("whole", 4096, 1100, 0, 10**9 // 1100, 10**9 // 1100 // 4096)
    assert rows["slots64"].requests == rows["builtin64"].requests == rows["whole"].requests
    ring = rows["ring64"]
    assert ring.ring_bytes == (64 + 15) * 100 and ring.bytes_per_token == 1000
    b = ring.requests
    assert b * 4096 * 1000 + (b + 1) * ring.ring_bytes <= 10**9 < (b + 1) * 4096 * 1000 + (b + 2) * ring.ring_bytes
    assert ring.max_total_tokens == (10**9 - (b + 1) * ring.ring_bytes) // 1000 and b > rows["whole"].requests


def test_capacity_arithmetic_is_sglangs_own_sizing():
    """For the Qwen3-8B + Qwen3-8B-DFlash-b16 shapes, every layout's token capacity and requests held, computed by
    SGLang's own sizing (its resolution of our flags, the hooked per-token cell, its pool configurator; a child
    process), equal the arithmetic."""
    from sglang_support import sglang_skip_reason

    if sglang_skip_reason() is not None:
        pytest.skip(sglang_skip_reason())
    from dflash_sglang.bench.memory.window_capacity import (QWEN3_8B, QWEN3_8B_DFLASH, capacity_rows, compare,
                                                      sglang_sizing_in_child, write_pair)

    import tempfile

    budget, contexts, windows = 40 * 2**30, [8192, 32768], [2048]
    target = kv_bytes_per_token(36, 8, 128, 2)
    rows = capacity_rows(budget, target, kv_bytes_per_token(5, 8, 128, 2), contexts, windows, 16)
    with tempfile.TemporaryDirectory() as tmp:
        sglang = sglang_sizing_in_child(*write_pair(Path(tmp), QWEN3_8B, QWEN3_8B_DFLASH), budget, contexts, windows)
    assert compare(rows, sglang) == [] and len(sglang) == len(rows) == 8
    ring = next(r for r in rows if r.layout == "ring2048" and r.context == 32768)
    assert ring.requests > next(r for r in rows if r.layout == "whole" and r.context == 32768).requests
