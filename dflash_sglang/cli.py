"""`dflash-sglang` command line: inspect | generate | train | demo.

Errors in user input (bad checkpoints, bad flags, prompts that do not fit) print one line naming the
file/field/flag and exit with status 2, before any decoding starts.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from dflash_sglang.hf_pair import encode, load_pair

EXIT_USAGE = 2
# Subcommands implemented elsewhere: (module, help). Each module exposes add_arguments(p) and run(args) -> int.
EXTERNAL = {
    "train": ("dflash_sglang.train.cli", "train a DFlash drafter for a target (z-lab checkpoint out)"),
    "demo": ("dflash_sglang.demo.main", "serve the SmolLM2 testbed pair through SGLang (or the reference decoder): "
                                        "plain vs DFLASH, interleaved, identical outputs, a table"),
}


class UsageError(ValueError):
    """Bad input at the command line boundary; printed as one line, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        print(f"dflash-sglang {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-sglang", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="validate a draft checkpoint (and its fit to a target); JSON summary")
    p.add_argument("draft", type=Path, help="draft checkpoint directory (config.json + model.safetensors)")
    p.add_argument("--target", type=Path, help="target model directory (its config.json is checked)")
    p.set_defaults(run=run_inspect)

    p = sub.add_parser("generate", help="speculative decoding with the reference decoder")
    p.add_argument("--target", type=Path, help="HF target directory (default: the embedded SmolLM2 testbed)")
    p.add_argument("--draft", type=Path, help="draft directory (default: the embedded SmolLM2 drafter)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts-file", type=Path, help='JSONL: {"prompt": str} or {"messages": [...]} per line')
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--block-size", type=int,
                   help="a fixed chain of B verify rows every step (no goodput controller); default: the checkpoint's "
                        "block size, each step's chain or tree from the goodput controller (as the server's default)")
    p.add_argument("--fixed", action="store_true",
                   help="a fixed chain of the block size every step instead of the goodput controller")
    p.add_argument("--tree-nodes", type=int, help="verify a draft tree of N nodes (root included) per step")
    p.add_argument("--tree-topk", type=int, default=4, help="candidates per draft position for --tree-nodes")
    p.add_argument("--adaptive", action="store_true",
                   help="alone: the goodput controller, with --block-size as its longest chain; with --adaptive-table: "
                        "the tree/chain per step from the running batch size")
    p.add_argument("--adaptive-table", default=None,
                   help="MAX_BS:NODESxTOPK rows ascending, the last MAX_BS 'inf' (e.g. the server's "
                        "--speculative-dflash-adaptive-table default)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    p.add_argument("--check-lossless", action="store_true", help="also decode without speculation and compare")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt (with the goodput controller: 'shapes', its batch's decode steps "
                        "per shape: '4' a chain of 4 rows, '8x4' a tree of 8 nodes over top-4)")
    p.set_defaults(run=run_generate)

    for name, (module, help_text) in EXTERNAL.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(run=_external(module), _external_module=module)
        mod = _try_import(module)
        if mod is not None:
            mod.add_arguments(p)
    return parser


def _try_import(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None  # subcommand not shipped in this build
        raise


def _external(module: str):
    def run(args: argparse.Namespace) -> int:
        mod = _try_import(module)
        if mod is None:
            raise UsageError(f"'{args.command}' is not available in this installation ({module} missing)")
        return mod.run(args)

    return run


# ---------------------------------------------------------------------------- inspect
def run_inspect(args: argparse.Namespace) -> int:
    from dflash_sglang.core.draft.checkpoint import check_fit, load_drafter

    drafter = load_drafter(args.draft)
    cfg = drafter.cfg
    params = sum(p.numel() for p in drafter.parameters())
    summary = {
        "draft": str(args.draft),
        "format": cfg.source_format,
        "config": cfg.summary(),
        "tensors": len(drafter.state_dict()),
        "parameters": params,
        "dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        "bytes": params * drafter.fc.weight.element_size(),
        # K of a reduced draft vocabulary (token_map.safetensors), else the full vocabulary
        "draft_vocab": cfg.vocab_size if drafter.token_map is None else len(drafter.token_map),
    }
    if args.target is not None:
        tcfg = args.target / "config.json"
        if not tcfg.is_file():
            raise UsageError(f"{tcfg}: missing (--target must be an HF model directory)")
        summary["target"] = {"path": str(args.target), **check_fit(cfg, json.loads(tcfg.read_text()),
                                                                    str(args.draft / "config.json"))}
        summary["fits_target"] = True
    print(json.dumps(summary, indent=2))
    return 0


# ---------------------------------------------------------------------------- generate
def read_prompts(args: argparse.Namespace) -> list:
    """Prompt texts or chat message lists, validated line by line."""
    if args.prompt is not None:
        return [args.prompt]
    if not args.prompts_file.is_file():
        raise UsageError(f"--prompts-file {args.prompts_file}: no such file")
    prompts = []
    for n, line in enumerate(args.prompts_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{args.prompts_file}:{n}: not valid JSON ({e})") from None
        item = obj.get("messages", obj.get("prompt")) if isinstance(obj, dict) else None
        if not isinstance(item, (str, list)) or not item:
            raise UsageError(f"{args.prompts_file}:{n}: needs a non-empty 'prompt' string or 'messages' list")
        prompts.append(item)
    if not prompts:
        raise UsageError(f"{args.prompts_file}: no prompts")
    return prompts


def adaptive_policy(table: str | None):
    from dflash_sglang.core.shape.adaptive import DEFAULT_TABLE, AdaptivePolicy

    try:
        return AdaptivePolicy.parse(table or DEFAULT_TABLE)
    except ValueError as e:
        raise UsageError(f"--adaptive-table {table!r}: {e}") from None


def spec_mode(args: argparse.Namespace) -> str:
    """How `generate` picks each step's verify shape: 'goodput' (the default, as the server's: no --block-size,
    no tree and no table, or --adaptive alone), 'chain' (--block-size or --fixed), 'tree' or 'table'."""
    if args.adaptive_table is not None and not args.adaptive:
        raise UsageError("--adaptive-table needs --adaptive")
    if args.adaptive and args.tree_nodes:
        raise UsageError("--adaptive picks the tree size itself; drop --tree-nodes")
    if args.fixed and (args.adaptive or args.tree_nodes):
        raise UsageError("--fixed verifies a chain of the block size every step; drop "
                         + ("--adaptive" if args.adaptive else "--tree-nodes"))
    if args.adaptive:
        return "table" if args.adaptive_table is not None else "goodput"
    if args.tree_nodes:
        return "tree"
    return "chain" if args.fixed or args.block_size is not None else "goodput"


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from dflash_sglang.core.reference import ReferenceDecoder
    from dflash_sglang.core.shape.adaptive import SpecShape
    from dflash_sglang.core.shape.goodput import DEFAULT_TREE_TOPK, GoodputConfig, GoodputController

    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if args.check_lossless and args.temperature != 0:
        raise UsageError("--check-lossless compares token identity, which needs --temperature 0")
    mode = spec_mode(args)
    if args.block_size is not None and args.block_size < 2:
        raise UsageError(f"--block-size must be >= 2, got {args.block_size}")
    if args.tree_nodes is not None and (args.tree_nodes < 1 or args.tree_topk < 1):
        raise UsageError("--tree-nodes and --tree-topk must be >= 1")
    if (args.target is None) != (args.draft is None):
        raise UsageError("give both --target and --draft, or neither (embedded default pair)")
    if args.target is None:
        from dflash_sglang.testbed import default_pair

        args.target, args.draft = default_pair()
    prompts = read_prompts(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer, drafter = load_pair(args.target, args.draft, device)
    ids = [encode(tokenizer, p, chat=not args.no_chat_template) for p in prompts]
    dec = ReferenceDecoder(target, drafter)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    eos_token_id=tokenizer.eos_token_id)
    # one controller for the whole run, as in a server: it keeps learning over the batches
    block = args.block_size or drafter.cfg.block_size
    controller = (GoodputController(GoodputConfig(max_nodes=block, max_depth=block - 1, max_topk=DEFAULT_TREE_TOPK))
                  if mode == "goodput" else None)
    shape = dict(
        tree=SpecShape(args.tree_nodes, args.tree_topk if args.tree_nodes >= 3 else 1) if mode == "tree" else None,
        policy=adaptive_policy(args.adaptive_table) if mode == "table" else None,
        controller=controller,
    )
    for start in range(0, len(ids), args.batch_size):
        chunk = ids[start:start + args.batch_size]
        before = dict(controller.counts) if controller is not None else {}
        t0 = time.perf_counter()
        outs = dec.generate(chunk, args.max_new_tokens, block_size=args.block_size, **sampling, **shape)
        elapsed = time.perf_counter() - t0
        shapes = None if controller is None else controller.steps_since(before)
        plain = dec.plain_generate(chunk, args.max_new_tokens, **sampling) if args.check_lossless else None
        for i, out in enumerate(outs):
            record = {
                "index": start + i,
                "text": tokenizer.decode(out.tokens, skip_special_tokens=True),
                "tokens": out.tokens,
                "accept_lengths": out.accept_lengths,
                "mean_accept_length": round(out.mean_accept_length, 4),
                "batch_seconds": round(elapsed, 3),
            }
            if shapes is not None:  # this batch's decode steps per shape ('4': a chain of 4 rows, 1 a plain step;
                # '8x4': a tree of 8 nodes over top-4)
                record["shapes"] = shapes
            if plain is not None:
                mismatch = next((j for j, (a, b) in enumerate(zip(out.tokens, plain[i])) if a != b), None)
                if mismatch is None and len(out.tokens) != len(plain[i]):
                    mismatch = min(len(out.tokens), len(plain[i]))
                record["lossless"] = mismatch is None
                record["first_mismatch"] = mismatch
            if args.json:
                print(json.dumps(record), flush=True)
            else:
                extra = f"  lossless={record['lossless']}" if plain is not None else ""
                print(f"[{record['index']}] tau={record['mean_accept_length']:.2f}{extra}\n{record['text']}\n")
    if controller is not None and not args.json:
        from dflash_sglang.demo.words import controller_verdict

        # What it chose, in words, before its numbers. No speed ratio: generate times one way once, and a single
        # timing is noise as often as speed (`dflash-sglang demo` times ways interleaved, with an interval).
        print(f"goodput {controller_verdict(controller.summary(min(args.batch_size, len(ids))))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
