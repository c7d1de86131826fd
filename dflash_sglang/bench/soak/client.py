"""The stress harness's HTTP client: one thread per in-flight request (stdlib http.client), so a request can be
streamed, aborted through /abort_request, or abandoned mid-stream exactly as a hostile client would.

`run_case` never raises: whatever happens becomes an `Outcome` (status, parsed answers, client-side error, hang,
disconnect) for the report to judge.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dflash_sglang.bench.soak.workload import CHAT, Case


@dataclass
class Answer:
    """One generated sequence (one of n, or one prompt of a batched /generate)."""

    text: str = ""
    ids: list[int] | None = None  # /generate only
    finish: str | None = None  # length | stop | abort | None (unfinished: a disconnected stream)
    matched: object = None  # the stop that matched (token id or string)
    prompt_ids: list[int] | None = None  # what the mismatch diagnosis re-sends to the plain server
    # chat with logprobs: per token (its logprob, [the top logprobs]), from choices[i].logprobs.content
    logprobs: list[tuple[float, list[float]]] | None = None


@dataclass
class Outcome:
    case: int
    status: int | None = None  # HTTP status (None: no response)
    answers: list[Answer] = field(default_factory=list)
    body: str = ""  # error responses: the start of the body
    error: str = ""  # client-side failure (connection reset, bad JSON, ...)
    hung: bool = False  # no progress within the request timeout
    disconnected: bool = False  # the client hung up on purpose
    abort_sent: bool = False
    completion_tokens: int | None = None  # chat usage
    seconds: float = 0.0


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def post_json(url: str, path: str, payload: dict, timeout: float = 30.0) -> tuple[int, object]:
    """(status, decoded body or raw text) of one POST; raises OSError on connection failure."""
    conn = http.client.HTTPConnection(*_host_port(url), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode(errors="replace")
        try:
            return resp.status, json.loads(raw)
        except json.JSONDecodeError:
            return resp.status, raw
    finally:
        conn.close()


def abort_request(url: str, rid: str) -> None:
    try:
        post_json(url, "/abort_request", {"rid": rid}, timeout=30)
    except OSError:
        pass  # the request's own outcome tells whether the abort landed


def _finish(reason) -> tuple[str | None, object]:
    if isinstance(reason, dict):
        return reason.get("type"), reason.get("matched")
    return reason, None


def _generate_answers(items: list[dict], prompt_ids) -> list[Answer]:
    prompts = prompt_ids if prompt_ids and isinstance(prompt_ids[0], list) else [prompt_ids] * len(items)
    out = []
    for item, prompt in zip(items, prompts):
        finish, matched = _finish(item.get("meta_info", {}).get("finish_reason"))
        out.append(Answer(item.get("text", ""), item.get("output_ids"), finish, matched, prompt))
    return out


def _chat_answers(body: dict) -> list[Answer]:
    choices = sorted(body.get("choices", []), key=lambda c: c.get("index", 0))
    return [Answer(c.get("message", {}).get("content") or "", None, c.get("finish_reason"), c.get("matched_stop"),
                   logprobs=_chat_logprobs(c.get("logprobs"))) for c in choices]


def _chat_logprobs(logprobs: dict | None) -> list[tuple[float, list[float]]] | None:
    if not logprobs or logprobs.get("content") is None:
        return None
    return [(t["logprob"], [x["logprob"] for x in t.get("top_logprobs") or []]) for t in logprobs["content"]]


def _stream_answers(events: list[dict], chat: bool, prompt_ids) -> list[Answer]:
    """Answers from SSE events: /generate sends the cumulative text and ids of each sequence (`index` for n > 1),
    chat sends per-choice deltas."""
    if not chat:
        last: dict[int, dict] = {}
        for ev in events:
            last[ev.get("index", 0)] = ev
        return _generate_answers([last[k] for k in sorted(last)], prompt_ids)
    answers: dict[int, Answer] = {}
    for ev in events:
        for ch in ev.get("choices", []):
            a = answers.setdefault(ch.get("index", 0), Answer())
            a.text += (ch.get("delta") or {}).get("content") or ""
            if ch.get("finish_reason"):
                a.finish, a.matched = ch["finish_reason"], ch.get("matched_stop")
    return [answers[k] for k in sorted(answers)]


def _read_stream(resp, url: str, case: Case, act: bool, out: Outcome) -> list[dict]:
    events = []
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            out.error = f"stream error: {json.dumps(ev['error'])[:300]}"
            break
        events.append(ev)
        if act and case.action and len(events) == case.after_chunks:
            if case.action == "disconnect":
                out.disconnected = True
                break
            abort_request(url, case.rid)
            out.abort_sent = True
    return events


def run_case(url: str, case: Case, timeout: float, act: bool = True) -> Outcome:
    """Send one case and read its answer. act=False ignores the case's abort/disconnect action (the plain server
    answers interrupted cases in full: the reference their partial answers are checked against)."""
    out, t0 = Outcome(case.id), time.monotonic()
    conn = http.client.HTTPConnection(*_host_port(url), timeout=timeout)
    timer = None
    act = act and bool(case.action)
    try:
        conn.request("POST", case.path, case.payload(), {"Content-Type": "application/json"})
        if act and not case.stream and case.action == "abort":
            timer = threading.Timer(case.delay_s, abort_request, (url, case.rid))
            timer.start()
            out.abort_sent = True
        elif act and not case.stream:  # abandon the request if no answer came within the delay
            conn.sock.settimeout(case.delay_s)
        resp = conn.getresponse()
        out.status = resp.status
        prompt = case.body.get("input_ids") if isinstance(case.body, dict) else None
        if resp.status == 200 and case.stream:
            out.answers = _stream_answers(_read_stream(resp, url, case, act, out), case.path == CHAT, prompt)
        else:
            raw = resp.read().decode(errors="replace")
            if resp.status != 200:
                out.body = raw[:500]
            else:
                body = json.loads(raw)
                if case.path == CHAT:
                    out.answers = _chat_answers(body)
                    out.completion_tokens = (body.get("usage") or {}).get("completion_tokens")
                else:
                    out.answers = _generate_answers(body if isinstance(body, list) else [body], prompt)
    except (TimeoutError, socket.timeout):
        if act and not case.stream and case.action == "disconnect":
            out.disconnected = True
        else:
            out.hung = True
    except (OSError, http.client.HTTPException, json.JSONDecodeError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        conn.close()
        if timer is not None:
            timer.join()  # the abort goes out even if the answer came first: a late abort must be harmless
    out.seconds = time.monotonic() - t0
    return out


def run_all(url: str, cases: list[Case], concurrency: int, timeout: float, act: bool = True) -> list[Outcome]:
    """Every case against one server, at most `concurrency` in flight; outcomes in case order."""
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        return list(pool.map(lambda c: run_case(url, c, timeout, act), cases))
    finally:
        # on an interrupt (SIGTERM -> SystemExit) do not wait for requests in flight: the caller stops the servers,
        # which ends them
        pool.shutdown(wait=False, cancel_futures=True)
