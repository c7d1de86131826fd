"""The stress harness (scripts/stress.py, dflash_sglang/bench/stress*.py).

Without SGLang: the workload's mix and invariants, every verdict of the report (a mismatch, a leak or a death
must fail the run: the exit code is checked on synthetic results), and the HTTP client against a stdlib fake
server (streams, disconnects, /abort_request). With SGLang and the SmolLM2 testbed: a small real run (plain, DFLASH
chain and tree CPU servers, a few dozen mixed requests with aborts, disconnects and bad requests) must pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sglang_support import sglang_skip_reason

from dflash_sglang.bench.soak import run as stress
from dflash_sglang.bench.common.server import Server
from dflash_sglang.bench.soak.client import Answer, Outcome, run_case
from dflash_sglang.bench.soak.report import Row, classify, judge, read_health, table
from dflash_sglang.bench.soak.workload import CHAT, GENERATE, Case, PromptPool, WorkloadSpec, build_workload

ROOT = Path(__file__).resolve().parents[1]
POOL = PromptPool(ids=tuple(tuple(range(i, i + 7 + 13 * i)) for i in range(12)),
                  texts=tuple(f"question {i}?" for i in range(12)), vocab_size=400, stop_token_ids=(3,))


# ---------------------------------------------------------------------------------------------- workload
def test_workload_mixes_every_kind_and_is_seeded():
    spec = WorkloadSpec(requests=200, aborts=24, context_len=256, seed=3, max_new=16, max_prompt=120)
    cases = build_workload(POOL, spec)
    assert len(cases) == 200 and len({c.id for c in cases}) == 200
    assert [c.id for c in cases] == [c.id for c in build_workload(POOL, spec)]  # same seed, same workload
    kinds = {c.kind for c in cases}
    assert {"greedy", "greedy_stream", "greedy_batch", "chat_greedy", "chat_logprobs", "sampled", "chat_sampled",
            "context_limit",
            "abort_stream", "abort_wait", "disconnect_stream", "disconnect_wait", "bad_json", "empty_text"} <= kinds
    assert sum(bool(c.action) for c in cases) == 24
    for c in cases:
        body = c.body if isinstance(c.body, dict) else {}
        ids = body.get("input_ids")
        if c.expect == "ok" and isinstance(ids, list) and ids and isinstance(ids[0], int):
            if c.kind == "context_limit":  # asks for exactly the most SGLang serves
                assert len(ids) + c.max_tokens == spec.context_len - 1 and len(ids) <= spec.context_len - 6
            else:
                assert 5 <= len(ids) <= spec.max_prompt and 1 <= c.max_tokens <= spec.max_new
        if c.action == "abort":
            assert body["rid"] == c.rid and c.compare
        if not c.plain:  # upstream's plain scheduler crashes on these: only ours gets them, and must refuse them
            assert c.expect == "refused"
            assert not ids or max(ids) >= POOL.vocab_size or body.get("text") == ""
    chats = [c for c in cases if c.path == CHAT and c.expect == "ok"]
    assert chats and all(c.body["max_tokens"] == c.max_tokens for c in chats)
    assert any(c.choices == 2 for c in cases) and any(c.stream for c in chats)


# ---------------------------------------------------------------------------------------------- verdicts
def _case(**kw) -> Case:
    return Case(**{"id": 1, "kind": "greedy", "path": GENERATE, "body": {"input_ids": [1, 2]}, "compare": True,
                   "max_tokens": 4, **kw})


def _out(*answers: Answer, **kw) -> Outcome:
    return Outcome(**{"case": 1, "status": 200, "answers": list(answers), **kw})


PLAIN = _out(Answer("abcd", [5, 6, 7, 8], "length"))


@pytest.mark.parametrize("case, out, verdict", [
    (_case(), _out(Answer("abcd", [5, 6, 7, 8], "length")), "ok"),
    (_case(), _out(Answer("abce", [5, 6, 7, 9], "length")), "mismatch"),
    (_case(), _out(Answer("ab", [5, 6], "abort")), "aborted"),  # a prefix of plain's
    (_case(), _out(Answer("ax", [5, 9], "abort")), "mismatch"),
    (_case(), _out(Answer("a", [5], None), disconnected=True), "disconnected"),
    (_case(), _out(Answer("x", [9], None), disconnected=True), "mismatch"),
    (_case(), _out(hung=True, status=None), "hang"),
    (_case(), _out(Answer("abcde", [5, 6, 7, 8, 1], "length")), "error"),  # over max_new_tokens
    (_case(), _out(Answer("ab", [5, 6], "length")), "error"),  # length before max_new_tokens
    (_case(kind="context_limit"), _out(Answer("abc", [5, 6, 7], "length")), "mismatch"),  # short is allowed, not !=
    (_case(compare=False, stops=("c",)), _out(Answer("abc", [5, 6, 7], "stop")), "error"),  # stop string left in
    # max_new_tokens reached by the token that completes the stop string (0.5.17 ends by length first): allowed
    (_case(compare=False, stops=("d",), max_tokens=4), _out(Answer("abcd", [5, 6, 7, 8], "length")), "ok"),
    (_case(compare=False, stops=("b",), max_tokens=4), _out(Answer("abcd", [5, 6, 7, 8], "length")), "error"),
    (_case(compare=False, choices=2), _out(Answer("ab", [5, 6], "stop")), "error"),  # n=2, one answer
    (_case(expect="refused"), _out(status=400, body='{"error": "DFLASH (dflash-sglang): empty prompt"}'), "refused"),
    (_case(expect="refused"), _out(Answer("a", [5], "length")), "error"),  # served what it must refuse
    (_case(expect="refused"), _out(status=500, body="Internal Server Error"), "error"),
    (_case(expect="maybe"), _out(status=400, body="no"), "refused"),
    (_case(expect="maybe"), _out(Answer("abcd", [5, 6, 7, 8], "length")), "ok"),
    (_case(expect="maybe"), _out(Answer("abcx", [5, 6, 7, 1], "length")), "mismatch"),  # served: must equal plain
    (_case(), _out(status=500, body="Internal Server Error"), "error"),
    (_case(), _out(status=None, error="ConnectionResetError"), "error"),
])
def test_classify(case, out, verdict):
    assert classify(case, out, PLAIN)[0] == verdict


def test_chat_logprobs_must_be_there_and_equal_plains():
    body = {"messages": [], "logprobs": True, "top_logprobs": 2}
    case = _case(path=CHAT, body=body, max_tokens=2)
    ref = _out(Answer("Hi!", None, "length", logprobs=[(-0.5, [-0.5, -1.0]), (-0.1, [-0.1, -3.0])]))
    def served(logprobs):
        return _out(Answer("Hi!", None, "length", logprobs=logprobs))
    assert classify(case, served([(-0.5, [-0.5, -1.0]), (-0.1 + 2e-4, [-0.1, -3.0])]), ref)[0] == "ok"
    assert classify(case, served(None), ref) == ("error", "answer 0: logprobs asked, none returned")
    assert "top_logprobs: expected 2" in classify(case, served([(-0.5, [-0.5]), (-0.1, [-0.1])]), ref)[1]
    assert "1 logprob entries" in classify(case, served([(-0.5, [-0.5, -1.0])]), ref)[1]
    assert "differ from plain at token 1" in classify(case, served([(-0.5, [-0.5, -1.0]), (-0.2, [-0.2, -3.0])]),
                                                      ref)[1]
    assert classify(_case(path=CHAT, max_tokens=3), served(None), ref)[0] == "ok"  # none asked: not checked


def test_chat_answers_compare_as_text_and_count_usage():
    case = _case(path=CHAT, max_tokens=3, choices=2)
    ref = _out(Answer("Hi there", None, "length"), Answer("Hi there", None, "length"))
    same = _out(Answer("Hi there", None, "length"), Answer("Hi there", None, "length"), completion_tokens=6)
    assert classify(case, same, ref)[0] == "ok"
    assert classify(case, _out(*same.answers, completion_tokens=7), ref)[0] == "error"
    assert classify(case, _out(Answer("Hi here", None, "length"), same.answers[1]), ref)[0] == "mismatch"


LEAK_LOG = """[2026-11-24 02:27:26] Decode batch, #running-req: 3
[2026-11-24 02:29:40] Scheduler hit an exception: Traceback (most recent call last):
  File "scheduler.py", line 5300, in on_idle
ValueError: pool memory leak detected! [full] total=16384, available=16300, evictable=60, protected=0, \
session_held=0, uncached=0
[2026-11-24 02:29:40] Received sigquit from a child process. It usually means the child failed.
"""


def test_leaks_and_deaths_are_read_from_the_log():
    health = read_health(LEAK_LOG, alive=False)
    assert health.dead and health.leaked_slots == 24 and "pool memory leak detected" in health.reason
    req_pool = "ValueError: req_to_token_pool memory leak detected!available_size=45, session_held=0, total_size=48"
    assert read_health(req_pool, alive=False).leaked_slots == 3
    clean = read_health("[..] Decode batch, #running-req: 3\n[..] Prefill batch, #new-seq: 1\n", alive=True)
    assert not clean.dead and clean.leaked_slots == 0
    assert read_health("", alive=False).dead  # the process is gone, whatever the log says


def test_any_failure_fails_the_row():
    cases = [_case(id=i) for i in range(3)]
    refs = {i: PLAIN for i in range(3)}
    good = [_out(*PLAIN.answers, case=i) for i in range(3)]
    row = judge("chain", 64, cases, good, refs)
    assert (row.requests, row.ok, row.compared, row.failed) == (3, 3, 3, False)
    bad = judge("chain", 64, cases, [*good[:2], _out(Answer("x", [9, 9, 9, 9], "length"), case=2)], refs,
                explain=lambda *_: " (gap 1e-06)")
    assert bad.mismatches == 1 and bad.failed and bad.failures == ["mismatch greedy #2: answer 0 differs from plain "
                                                                   "at token 0 (gap 1e-06)"]
    for name in ("errors", "hangs", "leaked_slots", "deaths"):
        assert Row("tree", 256, **{name: 1}).failed
    assert not Row("tree", 256, aborted=5, disconnected=5, refused=5).failed
    assert "| tree | 256 |" in table([Row("tree", 256)])


@pytest.mark.parametrize("rows, rc", [([Row("plain", 64, requests=9, ok=9), Row("chain", 64, requests=9, ok=9)], 0),
                                      ([Row("plain", 64), Row("chain", 64, leaked_slots=7)], 1),
                                      ([Row("plain", 64), Row("adaptive", 64, mismatches=1)], 1)])
def test_exit_code_and_json_line(monkeypatch, capsys, rows, rc):
    monkeypatch.setattr(stress, "run", lambda args: rows)
    assert stress.main(["--mode", "chain"]) == rc
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["script"] == "stress" and last["failed"] == bool(rc) and len(last["rows"]) == 2


# ---------------------------------------------------------------------------------------------- client
class _Fake(BaseHTTPRequestHandler):
    """/generate (streamed: 3 cumulative events) and /abort_request, as SGLang answers them."""

    aborted: list[str] = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):  # /health
        self._send(200, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            _Fake.aborted.append(body["rid"])
            return self._send(200, b"{}")
        ids = [7, 8, 9]
        if not body.get("stream"):
            return self._send(200, json.dumps({"text": "789", "output_ids": ids,
                                               "meta_info": {"finish_reason": {"type": "length"}}}).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in range(1, 4):
            finish = {"type": "length"} if k == 3 else None
            event = {"text": "789"[:k], "output_ids": ids[:k], "meta_info": {"finish_reason": finish}}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, data: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def fake_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_client_streams_aborts_and_disconnects(fake_url):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}, "rid": "stress-5"}
    plain = run_case(fake_url, _case(id=5, body=body, max_tokens=3), timeout=30)
    assert plain.status == 200 and plain.answers[0].ids == [7, 8, 9] and plain.answers[0].prompt_ids == [1, 2, 3]
    streamed = _case(id=5, body={**body, "stream": True}, stream=True, max_tokens=3)
    out = run_case(fake_url, streamed, timeout=30)
    assert out.answers[0].ids == [7, 8, 9] and out.answers[0].finish == "length" and not out.disconnected
    gone = run_case(fake_url, Case(**{**streamed.__dict__, "action": "disconnect", "after_chunks": 1}), timeout=30)
    assert gone.disconnected and gone.answers[0].ids == [7] and gone.answers[0].finish is None
    aborted = run_case(fake_url, Case(**{**streamed.__dict__, "action": "abort", "after_chunks": 2}), timeout=30)
    assert aborted.abort_sent and _Fake.aborted == ["stress-5"]
    # the plain reference ignores the action
    assert not run_case(fake_url, Case(**{**streamed.__dict__, "action": "disconnect", "after_chunks": 1}), timeout=30,
                        act=False).disconnected


def test_a_server_started_long_ago_is_asked_before_timing_out(fake_url, tmp_path):
    """The harness starts the next DFLASH server while the previous one works, maybe for longer than the startup
    timeout: waiting for it must still ask /health once (it used to give up without asking)."""
    srv = Server([], {}, tmp_path / "server.log", startup_timeout=1)
    srv.url, srv._started = fake_url, time.monotonic() - 3600
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert srv.wait_ready() is srv
    finally:
        srv.stop()
    assert srv.proc.poll() is not None


# ---------------------------------------------------------------------------------------------- real servers
def _testbed_reason() -> str | None:
    try:
        from dflash_sglang.testbed import default_pair
        from dflash_sglang.testbed.data import dataset_file

        default_pair(), dataset_file()
    except Exception as e:  # TestbedUnavailable, FileNotFoundError: the packages are not installed
        return f"the SmolLM2 testbed is unavailable: {e}"
    return None


@pytest.mark.slow
@pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))
def test_small_stress_run_passes(tmp_path):
    """CI's version of the soak: plain, DFLASH goodput (the default) and tree servers (CPU, SmolLM2 pair) on 32 mixed
    requests at concurrency 16 (aborts, disconnects, bad requests, context-limit requests); the run must exit 0."""
    if (why := _testbed_reason()) is not None:
        pytest.skip(why)
    cmd = [sys.executable, str(ROOT / "scripts" / "stress.py"), "--mode", "goodput,tree", "--requests", "32",
           "--concurrency", "16", "--aborts", "8", "--context-length", "256", "--max-prompt-tokens", "160",
           "--max-new-tokens", "16", "--request-timeout", "600", "--idle-timeout", "300", "--out", str(tmp_path)]
    # its tree server starts its processes as SGLang does (spawned: our worker loaded in a fresh scheduler process),
    # the suite's one check of that path; the plain and goodput servers fork them (tests/fork_start)
    proc = subprocess.run(["nice", *cmd], cwd=ROOT, env={**os.environ, "DFLASH_TEST_SPAWN": "--speculative-eagle-topk"},
                          capture_output=True, text=True, timeout=1500)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    res = json.loads(lines[-1])
    assert proc.returncode == 0 and not res["failed"], "\n".join(lines[:-1]) + proc.stderr[-3000:]
    rows = {r["server"]: r for r in res["rows"]}
    assert set(rows) == {"plain", "goodput", "tree"}
    spawned = {name for name in rows if "fork_start: this process spawns" in (tmp_path / f"{name}.log").read_text()}
    assert spawned == {"tree"}, spawned
    for mode in ("goodput", "tree"):
        r = rows[mode]
        assert r["requests"] == 32 and r["compared"] >= 10 and r["refused"] >= 3, r
        assert r["aborted"] + r["disconnected"] >= 2, r  # some interruptions landed before their request finished
        assert r["kinds"].get("empty_text") and r["kinds"].get("id_past_vocab"), r  # inputs that crash plain
        assert r["kinds"].get("chat_logprobs"), r  # OpenAI logprobs, equal to plain's (stress_report.LOGPROB_TOL)
