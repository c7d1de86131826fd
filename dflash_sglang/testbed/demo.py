"""`dflash-sglang demo`: speculative decoding on the SmolLM2 testbed, on CPU, with the core reference decoder.

Sets up the target (converting the packaged GGUF on first use), loads the shipped drafter, and decodes a few
held-out ShareGPT prompts one at a time, both speculatively and plainly. Prints the text, tau per prompt,
and the wall-clock ratio plain / speculative (> 1 means speculation was faster), and checks that greedy
speculative output equals plain output token for token.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=None, help="HF target dir (default: the testbed target)")
    p.add_argument("--draft", type=Path, default=None, help="draft dir (default: the shipped testbed drafter)")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run(args: argparse.Namespace) -> int:
    from ..core.checkpoint import load_drafter
    from ..core.reference import ReferenceDecoder
    from . import DRAFT_ASSET, convert_target, default_pair
    from .data import eval_prompts
    from .target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.draft is None and args.target is None:
        args.target, args.draft = default_pair()
    args.draft = args.draft or DRAFT_ASSET
    args.target = args.target or convert_target()
    target, tok = load_target(args.target)
    decoder = ReferenceDecoder(target, load_drafter(args.draft, dtype=torch.float32))
    block = args.block_size or decoder.cfg.block_size
    eos = tok.eos_token_id
    kw = dict(temperature=args.temperature, eos_token_id=eos)
    prompts = eval_prompts(tok, args.num_prompts)
    decoder.generate([list(prompts[0].ids)], 4, block_size=block, **kw)  # warm-up (first-call allocations)
    t_spec = t_plain = 0.0
    taus, mismatches = [], 0
    for i, p in enumerate(prompts):
        (gen,), dt_s = _timed(lambda: decoder.generate([list(p.ids)], args.max_new_tokens, block_size=block, **kw))
        (plain,), dt_p = _timed(lambda: decoder.plain_generate([list(p.ids)], args.max_new_tokens, **kw))
        t_spec, t_plain = t_spec + dt_s, t_plain + dt_p
        taus.append(gen.mean_accept_length)
        same = gen.tokens == plain
        mismatches += args.temperature == 0 and not same
        print(f"--- prompt {i} ({p.conv_id}): {p.text[:100]!r}")
        print(tok.decode(gen.tokens, skip_special_tokens=True))
        print(f"[tau {gen.mean_accept_length:.2f} over {len(gen.accept_lengths)} steps, {len(gen.tokens)} tokens; "
              f"spec {dt_s:.2f}s vs plain {dt_p:.2f}s"
              + (f"; identical to plain: {same}]" if args.temperature == 0 else "]"))
    print(f"=== block {block}, temperature {args.temperature}: mean tau {sum(taus) / len(taus):.2f}; "
          f"wall-clock plain/spec = {t_plain / t_spec:.2f}x ({t_plain:.1f}s / {t_spec:.1f}s, CPU, batch 1)")
    if mismatches:
        print(f"ERROR: {mismatches} greedy outputs differ from plain decoding")
        return 1
    return 0

