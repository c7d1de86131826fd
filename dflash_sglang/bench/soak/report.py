"""The stress harness's verdicts: each request's outcome judged against its case (and the plain server's answer),
the server's log read for deaths and SGLang's KV-leak invariant, and one table row per server and concurrency.

A row fails on any mismatch, error, hang, leaked slot or server death (`Row.failed`); the harness exits non-zero
if any row fails.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from dflash_sglang.bench.soak.client import Answer, Outcome
from dflash_sglang.bench.soak.workload import Case

VERDICTS = ("ok", "refused", "aborted", "disconnected", "mismatch", "error", "hang")
COUNTS = ("requests", "ok", "compared", "aborted", "disconnected", "refused", "mismatches", "errors", "hangs",
          "leaked_slots", "deaths")
FAILURES = ("mismatches", "errors", "hangs", "leaked_slots", "deaths")
_LEAK = re.compile(r"memory leak detected!\s*(.*)")
_FIELD = re.compile(r"(\w+)=(-?\d+)")
_DEATH = re.compile(r"Scheduler hit an exception|Received sigquit|SIGQUIT received|memory leak detected|"
                    r"double free|use-after-free")
_FIRST_FAILURES = 12  # details kept per row
LOGPROB_TOL = 1e-3  # float32 logprobs of one prefix through a verify row vs plain's 1-token decode (a loaded server)


def _check_answer(case: Case, a: Answer) -> str | None:
    """What is wrong with one served answer on its own (None: nothing)."""
    if a.finish not in ("length", "stop", "abort"):
        return f"finish reason {a.finish!r}"
    if a.ids is not None:
        if len(a.ids) > case.max_tokens:
            return f"{len(a.ids)} tokens > max {case.max_tokens}"
        # at the context limit SGLang ends a request by length before max_new_tokens (plain does the same)
        if a.finish == "length" and len(a.ids) != case.max_tokens and case.kind != "context_limit":
            return f"finished by length after {len(a.ids)} of {case.max_tokens} tokens"
    # A stop string completed by the last token may stay when the request also reached max_new_tokens there: SGLang
    # 0.5.17 checks the length first (0.5.23 the stop); one earlier in the text is always an error.
    at_end = a.finish == "length"
    if a.finish != "abort" and any(s in (a.text[: -len(s)] if at_end and a.text.endswith(s) else a.text)
                                   for s in case.stops):
        return f"stop string left in the text: {a.text[-60:]!r}"
    return None


def _same(a: Answer, ref: Answer, partial: bool) -> bool:
    """Greedy equality with the plain server's answer: ids where /generate gives them, else text; a partial answer
    (aborted or abandoned) must be a prefix of plain's."""
    mine, theirs = (a.ids, ref.ids) if a.ids is not None and ref.ids is not None else (a.text, ref.text)
    if partial:
        return theirs[: len(mine)] == mine
    return mine == theirs and (a.finish, a.matched) == (ref.finish, ref.matched)


def _logprob_problem(case: Case, a: Answer, ref: Answer) -> str | None:
    """A chat request that asked for logprobs: one entry per token with the asked top count, values equal to plain's
    within LOGPROB_TOL (None: nothing wrong, or none asked)."""
    body = case.body if isinstance(case.body, dict) else {}
    if not body.get("logprobs") or case.path != "/v1/chat/completions":
        return None
    if a.logprobs is None:
        return "logprobs asked, none returned"
    want_top = body.get("top_logprobs") or 0
    if any(len(top) != want_top for _, top in a.logprobs):
        return f"top_logprobs: expected {want_top} per token"
    if ref.logprobs is None or len(a.logprobs) != len(ref.logprobs):
        return f"{len(a.logprobs)} logprob entries, plain gave {len(ref.logprobs or [])}"
    for j, ((v, top), (rv, rtop)) in enumerate(zip(a.logprobs, ref.logprobs)):
        if abs(v - rv) > LOGPROB_TOL or any(abs(x - y) > LOGPROB_TOL for x, y in zip(top, rtop)):
            return f"logprobs differ from plain at token {j}: {v:.5f} vs {rv:.5f}"
    return None


def _first_difference(a: Answer, ref: Answer) -> int:
    mine, theirs = (a.ids, ref.ids) if a.ids is not None and ref.ids is not None else (a.text, ref.text)
    return next((k for k, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))


def classify(case: Case, out: Outcome, ref: Outcome | None) -> tuple[str, str]:
    """(verdict, detail) of one request on one server. ref: the plain server's outcome of the same case (None on the
    plain server itself)."""
    if out.hung:
        return "hang", "no progress within the request timeout"
    refusal = out.status is not None and 400 <= out.status < 500
    if case.expect == "refused":
        if refusal:
            return "refused", ""
        return "error", f"expected a 4xx, got {out.status}: {out.error or out.body[:200]}"
    if case.expect == "maybe" and refusal:  # refused (by us or by SGLang's own checks), never answered wrongly
        return "refused", ""
    if out.error and not out.disconnected:
        return "error", out.error
    if out.status != 200 and not out.disconnected:
        return "error", f"HTTP {out.status}: {out.body[:200]}"
    partial = out.disconnected or any(a.finish == "abort" for a in out.answers)
    if not out.disconnected:
        if len(out.answers) != case.choices:
            return "error", f"{len(out.answers)} answers, expected {case.choices}"
        for a in out.answers:
            if (why := _check_answer(case, a)) is not None:
                return "error", why
        if out.completion_tokens is not None and out.completion_tokens > case.max_tokens * case.choices:
            return "error", f"{out.completion_tokens} completion tokens > {case.choices} x {case.max_tokens}"
    if case.compare and ref is not None and ref.status == 200:
        for k, (a, r) in enumerate(zip(out.answers, ref.answers)):
            if not _same(a, r, partial):
                return "mismatch", f"answer {k} differs from plain at token {_first_difference(a, r)}"
            if (why := _logprob_problem(case, a, r)) is not None:
                return "error", f"answer {k}: {why}"
    if out.disconnected:
        return "disconnected", ""
    return ("aborted" if partial else "ok"), ""


@dataclass(frozen=True)
class ServerHealth:
    """What a server's log says after a workload: dead or not, and the KV slots SGLang's idle check found leaked."""

    dead: bool
    leaked_slots: int
    reason: str = ""


def read_health(log_text: str, alive: bool) -> ServerHealth:
    """Deaths and leaks from the log. SGLang's strict idle check raises `pool memory leak detected! [full] total=T,
    available=A, evictable=E, protected=P, ...` (and kills the server); leaked = T minus everything accounted."""
    leaked = 0
    for m in _LEAK.finditer(log_text):
        fields = {k: int(v) for k, v in _FIELD.findall(m.group(1))}
        if "total" in fields:  # token pool: total = available + evictable + protected + session_held + uncached
            leaked += fields["total"] - sum(v for k, v in fields.items() if k != "total")
        elif "total_size" in fields:  # request-slot pool
            leaked += fields["total_size"] - fields.get("available_size", 0) - fields.get("session_held", 0)
    lines = [ln for ln in log_text.splitlines() if _DEATH.search(ln)]
    errors = [ln for ln in log_text.splitlines() if re.match(r"^\w*(Error|Exception)\b", ln)]
    reason = (errors[-1] if errors else lines[-1] if lines else "").strip()[:300]
    return ServerHealth(dead=not alive or bool(lines), leaked_slots=max(leaked, 0), reason=reason)


@dataclass
class Row:
    server: str  # "plain" or the DFLASH mode
    concurrency: int
    requests: int = 0
    ok: int = 0
    compared: int = 0  # greedy answers checked against the plain server's (in full or as a prefix)
    aborted: int = 0  # ended by /abort_request
    disconnected: int = 0  # abandoned by the client
    refused: int = 0  # expected 4xx (malformed, or a feature / input our worker refuses)
    mismatches: int = 0
    errors: int = 0
    hangs: int = 0  # no answer within the request timeout, or still running when the server should be idle
    leaked_slots: int = 0  # KV slots SGLang's idle leak check found missing
    deaths: int = 0  # the server process died
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(getattr(self, name) for name in FAILURES)

    def add(self, case: Case, verdict: str, detail: str, compared: bool) -> None:
        self.requests += 1
        self.kinds[case.kind] = self.kinds.get(case.kind, 0) + 1
        self.compared += compared and verdict in ("ok", "aborted", "disconnected", "mismatch")
        plural = {"mismatch": "mismatches", "error": "errors", "hang": "hangs"}
        name = plural.get(verdict, verdict)
        setattr(self, name, getattr(self, name) + 1)
        if verdict in plural:
            self.note(f"{verdict} {case.kind} #{case.id}: {detail}")

    def note(self, text: str) -> None:
        if len(self.failures) < _FIRST_FAILURES:
            self.failures.append(text)

    def as_dict(self) -> dict:
        return {**asdict(self), "failed": self.failed}


def judge(server: str, concurrency: int, cases: list[Case], outcomes: list[Outcome],
          refs: dict[int, Outcome] | None, explain=None) -> Row:
    """One row from a workload's outcomes (refs: the plain server's outcomes by case id; None for plain itself).
    explain(case, outcome, ref) -> str, if given, adds to a mismatch's detail (the plain server's top-2 gap)."""
    row = Row(server, concurrency)
    for case, out in zip(cases, outcomes):
        ref = refs.get(case.id) if refs is not None else None
        verdict, detail = classify(case, out, ref)
        if verdict == "mismatch" and explain is not None:
            detail += explain(case, out, ref)
        row.add(case, verdict, detail, compared=case.compare and ref is not None and ref.status == 200)
    return row


def table(rows: list[Row]) -> str:
    """A markdown table (pasted into docs/benchmarks.md as is)."""
    head = ["server", "concurrency", *COUNTS, "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r.server, str(r.concurrency), *(str(getattr(r, c)) for c in COUNTS),
                                        f"{r.seconds:.0f}"]) + " |")
    return "\n".join(lines)
