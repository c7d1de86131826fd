"""Draft KV memory options compared: acceptance (tau) per draft KV dtype, and what one memory budget holds per option.

`tau`: the reference decoder (core/reference.py, greedy, the testbed pair, ShareGPT eval prompts) with the drafter
reading its K/V as each draft KV dtype stores them (core/draft/draft_kv.py: the model dtype, bf16, fp8_e4m3, fp8_e5m2);
tau = committed tokens per verify step, the prefill token counted (as SGLang reports it). Greedy output must equal
plain decoding in every arm (lossless: a mismatch exits 1). Not timed.

`window`: the same decoder with the drafter's sliding context window (core/draft/drafter.py `context_window`, the
definition of `--speculative-draft-window-size W`) on long multi-turn ShareGPT eval contexts, tau per W and each
prompt's tau over its whole-context tau (median, 95% interval over the prompts: what the window costs). With
`--engine`, also one CPU Engine per W (one at a time, greedy chains of the drafter block, the radix cache off in every
arm): its tau from SGLang's per-request verify counts and whether its output equals the reference decoder's. Not
timed.

`plan`: a fixed KV memory budget in bytes -> per option the bytes per token SGLang's sizing counts (target KV +
our draft pool row, adapter/draft/memory.py) and, for a draft window W (`--windows`), the bytes per request slot of
its ring (R = W + N - 1 rows, adapter/draft/context_rows.py; 0 B/token), the token capacity (`--max-total-tokens`) that
budget holds, and the largest batch of requests of a given length it admits; then the CPU Engine command
(scripts/bench_engine.py: every arm at its own `--max-total-tokens` and `--max-running-requests`, token-identical to
plain, tau per arm) that measures tokens/s at that batch. SGLang fills memory by the same division, so the
capacities are what a server given that budget would get; the Engine run checks that the batch runs.

`capacity`: what a draft window is for at long contexts (8k-32k tokens), per draft pool layout, for the Qwen3-8B +
Qwen3-8B-DFlash-b16 shapes, checked against SGLang's own sizing (bench/memory/window_capacity.py).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash_sglang.measure.spread import RatioSpread

DTYPES = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2")  # draft KV arms ("auto": the model dtype)
REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class BudgetRow:
    """One draft KV option under a fixed KV memory budget."""

    draft_kv: str  # the option's name: a draft KV dtype, or `window<W>`
    target_bytes_per_token: int
    draft_bytes_per_token: int
    max_total_tokens: int  # the token capacity the budget holds (target and draft pools together)
    largest_batch: int  # requests of `request_tokens` each that fit at once
    draft_bytes_per_request: int = 0  # a draft window's ring per request slot (0: the pool grows per token)
    window: int | None = None  # W of a window option

    @property
    def bytes_per_token(self) -> int:
        return self.target_bytes_per_token + self.draft_bytes_per_token


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V of every layer for one token."""
    return 2 * layers * kv_heads * head_dim * element_size


def budget_rows(budget_bytes: int, target_bytes_per_token: int, draft_rows: dict[str, int],
                request_tokens: int, windows: dict[int, int] | None = None) -> list[BudgetRow]:
    """draft_rows: option -> draft pool bytes per token. Each option's capacity is budget // (target + draft) tokens
    (SGLang's division of its KV memory by the per-token cell), its largest batch capacity // request_tokens.
    windows: W -> the ring's bytes per request slot; the largest batch b is the most with b + 1 request slots' rings
    (SGLang's req_to_token rows: --max-running-requests + 1, allocated before the sizing) and b requests' target KV
    within the budget, and the capacity what is left after the rings, in target tokens."""
    assert budget_bytes > 0 and request_tokens > 0
    rows = []
    for name, draft in draft_rows.items():
        tokens = budget_bytes // (target_bytes_per_token + draft)
        rows.append(BudgetRow(name, target_bytes_per_token, draft, tokens, tokens // request_tokens))
    for window, ring in (windows or {}).items():
        batch = max(0, (budget_bytes - ring) // (request_tokens * target_bytes_per_token + ring))
        tokens = max(0, budget_bytes - (batch + 1) * ring) // target_bytes_per_token
        rows.append(BudgetRow(f"window{window}", target_bytes_per_token, 0, tokens, batch, ring, window))
    return rows


def engine_command(rows: list[BudgetRow], new_tokens: int, repeats: int) -> list[str]:
    """scripts/bench_engine.py over plain (its own default capacity: the speed baseline) and one DFLASH arm per option,
    each at the capacity the budget gives it and its largest batch as the running limit; the concurrency is the
    largest of those batches (an arm admitting fewer queues the rest, as a server at that budget would)."""
    arms = ["plain"]
    for r in rows:
        if r.window is not None:  # (the radix cache off, as a window needs; bench_engine's prompts share no prefix)
            extra = f";speculative_draft_window_size={r.window};disable_radix_cache=True"
        else:
            extra = "" if r.draft_kv == "auto" else f";speculative_draft_kv_cache_dtype={r.draft_kv}"
        arms.append(f"kv_{r.draft_kv}:max_total_tokens={r.max_total_tokens};"
                    f"max_running_requests={r.largest_batch}{extra}")
    batch = max(r.largest_batch for r in rows)
    return [sys.executable, str(REPO / "scripts" / "bench_engine.py"), "--arms", ",".join(arms),
            "--concurrency", str(batch), "--new-tokens", str(new_tokens), "--repeats", str(repeats),
            "--out", str(REPO / "work_tmp" / "bench_draft_memory")]


def reference_tau(target, drafter, prompts: list[list[int]], new_tokens: int, block: int,
                  dtypes: tuple[str, ...] = DTYPES) -> dict[str, dict]:
    """Per draft KV dtype: tau and whether greedy output equals plain decoding (the same prompts, one batch)."""
    from dflash_sglang.core.draft.draft_kv import kv_format
    from dflash_sglang.core.reference import ReferenceDecoder

    decoder = ReferenceDecoder(target, drafter)
    plain = decoder.plain_generate(prompts, new_tokens)
    plain_ids = [p.tokens if hasattr(p, "tokens") else p for p in plain]
    compute = drafter.fc.weight.dtype
    out = {}
    try:
        for name in dtypes:
            drafter.kv_format = kv_format(name, compute)
            gens = decoder.generate(prompts, new_tokens, block_size=block)
            steps = sum(len(g.accept_lengths) for g in gens)
            out[name] = {"tau": sum(len(g.tokens) for g in gens) / steps, "steps": steps,
                         "lossless": [g.tokens for g in gens] == plain_ids}
            print(f"[tau] {name}: {out[name]}", file=sys.stderr, flush=True)  # (progress on a slow machine)
    finally:
        drafter.kv_format = None
    return out


def multi_turn_prompts(tokenizer, convs, n: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    """The first n conversations templated up to their last human turn (every earlier turn included, the assistant
    header appended) whose length is within [min_tokens, max_tokens]: long multi-turn contexts."""
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for conv in convs:
        turns = [(roles[who], text) for who, text in conv.turns if who in roles]
        while turns and turns[-1][0] == "assistant":
            turns.pop()
        if len(turns) < 3:  # at least one earlier exchange
            continue
        ids = list(tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in turns],
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"])
        if min_tokens <= len(ids) <= max_tokens:
            out.append(ids)
            if len(out) >= n:
                break
    return out


def window_tau(target, drafter, prompts: list[list[int]], new_tokens: int, block: int,
               windows: tuple[int | None, ...]) -> dict[str, dict]:
    """Per draft window W (None: the whole context): tau and greedy identity with plain decoding."""
    from dflash_sglang.core.reference import ReferenceDecoder

    decoder = ReferenceDecoder(target, drafter)
    plain = [p.tokens if hasattr(p, "tokens") else p for p in decoder.plain_generate(prompts, new_tokens)]
    out = {}
    try:
        for w in windows:
            drafter.context_window = w
            gens = decoder.generate(prompts, new_tokens, block_size=block)
            steps = sum(len(g.accept_lengths) for g in gens)
            out["full" if w is None else str(w)] = {"tau": sum(len(g.tokens) for g in gens) / steps, "steps": steps,
                                                    "lossless": [g.tokens for g in gens] == plain,
                                                    "prompt_tau": [len(g.tokens) / len(g.accept_lengths) for g in gens],
                                                    "ids": [g.tokens for g in gens]}
            print(f"[window] {w}: tau {out['full' if w is None else str(w)]['tau']:.3f}", file=sys.stderr, flush=True)
    finally:
        drafter.context_window = None
    return out


def _load_pair(args: argparse.Namespace):
    """The pair the `tau` and `window` modes decode with (--target / --draft, else the testbed pair) in --dtype ->
    (target_dir, draft_dir, target model, drafter, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.testbed import default_pair

    target_dir, draft_dir = (Path(args.target), Path(args.draft)) if args.target else default_pair()
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    drafter = load_drafter(draft_dir, dtype=dtype).eval()
    return target_dir, draft_dir, target, drafter, AutoTokenizer.from_pretrained(target_dir)


def _window(args: argparse.Namespace) -> int:
    from dflash_sglang.testbed.data import load_split

    target_dir, draft_dir, target, drafter, tokenizer = _load_pair(args)
    prompts = multi_turn_prompts(tokenizer, load_split("eval"), args.prompts, args.min_prompt_tokens,
                                 args.max_prompt_tokens)
    block = args.block or drafter.cfg.block_size
    windows = tuple(None if w == "full" else int(w) for w in args.windows.split(","))
    res = window_tau(target, drafter, prompts, args.new_tokens, block, windows)
    if args.engine:
        engine = window_engine_tau(target_dir, draft_dir, prompts, args.new_tokens, block, windows, args.dtype,
                                   Path(args.out))
        for name, r in engine.items():
            ref = res[name]
            r["equals_reference"] = r["ids"] == ref.pop("ids")
            res[name] = {**ref, "engine_tau": r["tau"], "engine_steps": r["steps"],
                         "engine_equals_reference": r["equals_reference"]}
    for r in res.values():
        r.pop("ids", None)
    full = res.get("full")
    for r in res.values():  # each prompt's tau over its whole-context tau: the window's cost, prompt by prompt
        if full is not None:
            spread = RatioSpread.paired(r["prompt_tau"], full["prompt_tau"])
            r["vs_full"] = {"median": spread.median, "interval": spread.interval}
    lens = [len(p) for p in prompts]
    print(f"reference decoder, {len(prompts)} ShareGPT eval multi-turn prompts ({min(lens)}..{max(lens)} tokens, "
          f"mean {sum(lens) / len(lens):.0f}) x {args.new_tokens} new tokens, block {block}, model {args.dtype}")
    print(f"{'window':<8} {'tau':>6} {'steps':>6} lossless {'per-prompt tau / full: median (95% interval)':>46}"
          + (" engine_tau engine=reference" if args.engine else ""))
    for name, r in res.items():
        engine = f" {r['engine_tau']:10.3f} {r['engine_equals_reference']}" if "engine_tau" in r else ""
        vs = r.get("vs_full")
        ci = vs["interval"] if vs else None
        ratio = f"{vs['median']:.3f} ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "-"
        print(f"{name:<8} {r['tau']:6.3f} {r['steps']:6d} {str(r['lossless']):<8} {ratio:>46}{engine}")
    print(json.dumps({"mode": "window", "prompts": len(prompts), "prompt_tokens": [min(lens), max(lens)],
                      "new_tokens": args.new_tokens, "block": block, "dtype": args.dtype, "windows": res}))
    return 0 if all(r["lossless"] and r.get("engine_equals_reference", True) for r in res.values()) else 1


def window_engine_tau(target_dir: Path, draft_dir: Path, prompts: list[list[int]], new_tokens: int, block: int,
                      windows: tuple[int | None, ...], dtype: str, out: Path) -> dict[str, dict]:
    """Per draft window W (None: the whole context): one CPU Engine (measure/passes.py's child, one at a time),
    greedy chains of `block` rows, the radix cache off -> tau (committed tokens per verify step, SGLang's counts) and
    its output ids. A failed Engine raises."""
    from dflash_sglang.measure.passes import run_arm

    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(new_tokens=new_tokens, sampling=[], out=out, env={}, child_timeout=3600.0)
    longest = max(len(p) for p in prompts) + new_tokens + 2 * block
    common = dict(model_path=str(target_dir), speculative_algorithm="DFLASH",
                  speculative_draft_model_path=str(draft_dir), speculative_num_draft_tokens=block, device="cpu",
                  dtype=dtype, attention_backend="torch_native", disable_radix_cache=True, log_level="warning",
                  random_seed=0, max_total_tokens=len(prompts) * longest, chunked_prefill_size=512)
    plan = [{"key": "window", "pass": 0, "group": "window", "c": len(prompts), "phase": "eval", "ids": prompts}]
    res = {}
    for w in windows:
        name = "full" if w is None else str(w)
        kwargs = {} if w is None else {"speculative_draft_window_size": w}
        got = run_arm(f"window_{name}", kwargs, plan, args, common)
        if got is None:
            raise RuntimeError(f"the Engine with draft window {name} failed (log in {out})")
        rnd = got["rounds"][0]
        steps = sum(rnd["verify_ct"])
        res[name] = {"tau": sum(len(i) for i in rnd["ids"]) / steps, "steps": steps, "ids": rnd["ids"]}
        print(f"[window engine] {name}: tau {res[name]['tau']:.3f}", file=sys.stderr, flush=True)
    return res


def _tau(args: argparse.Namespace) -> int:
    from dflash_sglang.testbed.data import eval_prompts

    _, _, target, drafter, tokenizer = _load_pair(args)
    prompts = [list(p.ids) for p in eval_prompts(tokenizer, args.prompts, args.max_prompt_tokens)]
    block = args.block or drafter.cfg.block_size
    res = reference_tau(target, drafter, prompts, args.new_tokens, block, tuple(args.dtypes.split(",")))
    print(f"reference decoder, {len(prompts)} ShareGPT eval prompts x {args.new_tokens} new tokens, block {block}, "
          f"model {args.dtype}")
    print(f"{'draft KV':<10} {'tau':>6} {'steps':>6} lossless")
    for name, r in res.items():
        print(f"{name:<10} {r['tau']:6.3f} {r['steps']:6d} {r['lossless']}")
    print(json.dumps({"mode": "tau", "prompts": len(prompts), "new_tokens": args.new_tokens, "block": block,
                      "dtype": args.dtype, "arms": res}))
    return 0 if all(r["lossless"] for r in res.values()) else 1


def _plan(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from dflash_sglang.core.draft.config import DraftConfig
    from dflash_sglang.core.draft.draft_kv import parse_kv_dtype
    from dflash_sglang.testbed import default_pair

    target_dir, draft_dir = (Path(args.target), Path(args.draft)) if args.target else default_pair()
    model = getattr(torch, args.dtype)
    hf = AutoConfig.from_pretrained(target_dir)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    elem = torch.empty((), dtype=model).element_size()
    target = kv_bytes_per_token(hf.num_hidden_layers, hf.num_key_value_heads, head_dim, elem)
    cfg = DraftConfig.load(draft_dir)
    draft = {name: kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                      torch.empty((), dtype=parse_kv_dtype(name) or model).element_size())
             for name in args.dtypes.split(",")}
    if "auto" not in draft:
        raise SystemExit("--dtypes must include auto (the default arm the others are compared with)")
    # a window's ring: R = W + N - 1 rows in the model dtype, N = the drafter block (bench_engine's DFLASH arms)
    windows = {w: (w + cfg.block_size - 1) * draft["auto"] for w in map(int, filter(None, args.windows.split(",")))}
    request = args.prompt_tokens + args.new_tokens
    rows = budget_rows(int(args.budget_mib * 2**20), target, draft, request, windows)
    print(f"KV budget {args.budget_mib} MiB, model {args.dtype}, requests of {request} tokens")
    print(f"{'draft KV':<10} {'target B/tok':>12} {'draft B/tok':>11} {'draft B/req':>11} {'max tokens':>10} "
          f"{'largest batch':>13}")
    for r in rows:
        print(f"{r.draft_kv:<10} {r.target_bytes_per_token:12d} {r.draft_bytes_per_token:11d} "
              f"{r.draft_bytes_per_request:11d} {r.max_total_tokens:10d} {r.largest_batch:13d}")
    cmd = engine_command(rows, args.new_tokens, args.repeats)
    print("timed command (run in a quiet window):", shlex.join(cmd))
    print(json.dumps({"mode": "plan", "budget_mib": args.budget_mib, "request_tokens": request,
                      "rows": [asdict(r) for r in rows], "command": cmd}))
    return 0


def _capacity(args: argparse.Namespace) -> int:
    """The window's capacity at long contexts (bench/memory/window_capacity.py): the arithmetic per layout, checked
    against SGLang's own sizing in a child process (exit 1 where they differ)."""
    import tempfile

    from dflash_sglang.bench.memory.window_capacity import (QWEN3_8B, QWEN3_8B_DFLASH, capacity_rows, compare,
                                                            sglang_sizing_in_child, write_pair)

    budget = int(args.budget_gib * 2**30)
    contexts = [int(c) for c in args.contexts.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    target, draft = QWEN3_8B, QWEN3_8B_DFLASH
    elem = 2  # bf16
    target_cell = kv_bytes_per_token(target["num_hidden_layers"], target["num_key_value_heads"], target["head_dim"],
                                     elem)
    draft_row = kv_bytes_per_token(draft["num_hidden_layers"], draft["num_key_value_heads"], draft["head_dim"], elem)
    rows = capacity_rows(budget, target_cell, draft_row, contexts, windows, draft["block_size"])
    with tempfile.TemporaryDirectory() as tmp:
        sglang = sglang_sizing_in_child(*write_pair(Path(tmp), target, draft), budget, contexts, windows)
    differ = compare(rows, sglang)
    print(f"Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 shapes (bf16, TP 1), KV budget {args.budget_gib} GiB: target "
          f"{target_cell} B/token, draft row {draft_row} B; requests of each context length held at once")
    print(f"{'layout':<12} {'context':>8} {'B/token':>8} {'ring B/slot':>12} {'max tokens':>10} {'requests':>8} "
          f"{'vs whole':>8}")
    whole = {r.context: r.requests for r in rows if r.layout == "whole"}
    for r in rows:
        gain = f"{r.requests / whole[r.context]:.2f}x" if whole[r.context] else "-"
        print(f"{r.layout:<12} {r.context:8d} {r.bytes_per_token:8d} {r.ring_bytes:12d} {r.max_total_tokens:10d} "
              f"{r.requests:8d} {gain:>8}")
    print("SGLang's own sizing:", "agrees on every row" if not differ else "DIFFERS: " + "; ".join(differ))
    print(json.dumps({"mode": "capacity", "budget_gib": args.budget_gib, "rows": [asdict(r) for r in rows],
                      "sglang_agrees": not differ}))
    return 1 if differ else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("tau", "plan", "window", "capacity"):
        s = sub.add_parser(name)
        s.add_argument("--target", help="target dir (default: the testbed pair)")
        s.add_argument("--draft", help="draft dir (with --target)")
        s.add_argument("--dtype", default="float32", help="model dtype (torch name)")
        s.add_argument("--dtypes", default=",".join(DTYPES), help="draft KV arms, SGLang's names")
        s.add_argument("--new-tokens", type=int, default=64)
    tau = sub.choices["tau"]
    tau.add_argument("--prompts", type=int, default=32)
    tau.add_argument("--max-prompt-tokens", type=int, default=256)
    tau.add_argument("--block", type=int, default=None, help="drafter block (default: the checkpoint's)")
    window = sub.choices["window"]
    window.add_argument("--windows", default="32,128,512,full", help="draft windows W (full: the whole context)")
    window.add_argument("--prompts", type=int, default=16)
    window.add_argument("--min-prompt-tokens", type=int, default=512)
    window.add_argument("--max-prompt-tokens", type=int, default=2048)
    window.add_argument("--block", type=int, default=None, help="drafter block (default: the checkpoint's)")
    window.add_argument("--engine", action="store_true", help="also tau per W in a CPU Engine (one at a time)")
    window.add_argument("--out", default=str(REPO / "work_tmp" / "bench_draft_window"), help="--engine's logs")
    plan = sub.choices["plan"]
    plan.add_argument("--budget-mib", type=float, default=64.0, help="KV memory budget (target + draft pools)")
    plan.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per request")
    plan.add_argument("--repeats", type=int, default=3)
    plan.add_argument("--windows", default="", help="draft windows W to plan beside the dtypes (comma list)")
    capacity = sub.choices["capacity"]
    capacity.add_argument("--budget-gib", type=float, default=40.0, help="KV budget (SGLang's available bytes)")
    capacity.add_argument("--contexts", default="8192,16384,32768", help="tokens per request (comma list)")
    capacity.add_argument("--windows", default="512,2048,4096", help="draft windows W (comma list)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"tau": _tau, "plan": _plan, "window": _window, "capacity": _capacity}[args.mode](args)
