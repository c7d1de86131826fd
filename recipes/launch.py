#!/usr/bin/env python3
"""Launch an SGLang server from a recipe: `python recipes/launch.py FAMILY HW [--impl ours|builtin|none] [--dry-run]
[--target PATH] [--draft PATH] [--pd prefill|decode [--bootstrap-port P]] [-- EXTRA SGLANG ARGS]`.

FAMILY is a file stem in this directory (qwen3-8b, gpt-oss-120b, ...), HW one of h100 h200 b200 b300. The recipe's
`measured` line is printed first; `--dry-run` prints the command instead of running it.
"""
from __future__ import annotations

import argparse
import os
import sys

from dflash_sglang.bench.serving import recipe as recipes
from dflash_sglang.pairs import pair_for


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=recipes.names())
    p.add_argument("hw", choices=recipes.HARDWARE)
    p.add_argument("--impl", choices=recipes.IMPLS,
                   help="DFLASH worker: ours, builtin (SGLang's), none (no speculation baseline); default: ours "
                        "where our worker supports the table (no builtin_only field), else builtin")
    p.add_argument("--target", help="local copy of the target (default: the recipe's hub repo)")
    p.add_argument("--draft", help="local copy of the draft (default: the recipe's hub repo)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("--pd", choices=recipes.PD_SIDES, help="this server's side in PD disaggregation (recipes/pd.md)")
    p.add_argument("--bootstrap-port", type=int, default=recipes.PD_BOOTSTRAP_PORT,
                   help="--pd prefill: the port its decode peers bootstrap from")
    args = p.parse_args(argv)
    r = recipes.load(args.family)
    try:
        measured = r.on(args.hw).measured
    except recipes.RecipeError as e:  # no table for this GPU (e.g. Kimi-K2.5 on H100): the header says why
        omitted = [ln for ln in r.header.splitlines() if ln.strip().startswith(f"{args.hw}: omitted")]
        raise SystemExit(f"{e}" + (f" ({omitted[0].strip()})" if omitted else "")) from None
    print(f"# {r.name} on {args.hw}: measured: {measured}", file=sys.stderr)
    unverified = pair_for(r.draft).unverified
    if unverified:  # facts of the pair no published source gave us: the server reads them from the checkpoints
        print(f"# unverified in dflash_sglang.pairs (the server reads the shapes from the checkpoints at start-up): "
              f"{', '.join(unverified)}", file=sys.stderr)
    if args.impl is None:
        args.impl = r.default_impl(args.hw)
        why = r.ours_refusal(args.hw)
        print(f"# impl: {args.impl}" + (f" ({why})" if why else ""), file=sys.stderr)
    kw = dict(target=args.target, draft=args.draft, extra=extra, pd=args.pd, bootstrap_port=args.bootstrap_port)
    try:
        argv = r.server_args(args.hw, args.impl, **kw)
    except recipes.RecipeError as e:
        raise SystemExit(str(e)) from None
    if args.dry_run:
        print(r.command(args.hw, args.impl, **kw))
        return 0
    cmd = [sys.executable, "-m", "sglang.launch_server", *argv]
    os.execvpe(cmd[0], cmd, {**os.environ, **r.server_env(args.hw, args.impl)})


if __name__ == "__main__":
    raise SystemExit(main())
