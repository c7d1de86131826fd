"""The command line, `python -m dflash_sglang.bench.gpu.train ACTION` (what scripts/gpu_train.sh runs): prepare and
reassemble here, receive and run on the device, rehearse on the CPU. Every refusal (a ValueError from the other
modules) prints `gpu_train: REFUSED: ...` and exits 2; `run` exits 1 when any phase failed."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dflash_sglang.bench.gpu import train as package
from dflash_sglang.bench.gpu.context import Budget
from dflash_sglang.bench.gpu.train.carry import MIB, carried_folders, reassemble, receive
from dflash_sglang.bench.gpu.train.plan import REPO, SHIPPED, SIZES, Places, prepare, run_calls
from dflash_sglang.bench.gpu.train.rehearsal import rehearse
from dflash_sglang.bench.gpu.train.window import Window, split_budget


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # (gpu_train.sh puts --started-at before the folder)
    started_s = max(time.time() - args.started_at, 0.0) if args.started_at else 0.0
    places = Places.for_device("cpu" if args.action == "rehearse" else "cuda", args.out)
    try:
        if args.action == "prepare":
            return _prepare(places, args)
        if args.action == "receive":
            return _receive(places)
        if args.action == "reassemble":
            return _reassemble(args)
        if args.action == "rehearse":
            return rehearse(places, started_s)
    except ValueError as e:
        print(f"gpu_train: REFUSED: {e}", file=sys.stderr)
        return 2
    return _run(places, args, started_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_sglang.bench.gpu.train",
                                description=package.__doc__.splitlines()[0])
    p.add_argument("action", choices=("prepare", "receive", "run", "reassemble", "rehearse"))
    p.add_argument("returned", nargs="?", type=Path, help="reassemble: the folder the window's files came back to")
    p.add_argument("--to", type=Path, default=REPO / "work_tmp" / "gpu_train_drafter", help="reassemble: where to")
    p.add_argument("--budget-s", type=float, help="run: seconds for the whole call (default 540)")
    p.add_argument("--started-at", type=float, help="the call's start (epoch seconds; gpu_train.sh passes it)")
    p.add_argument("--out", type=Path, help="run / rehearse: the returned folder (default $OUT)")
    p.add_argument("--init", default=str(SHIPPED), help="run: the drafter to continue (default: the shipped one); "
                                                        "'target' starts afresh with the shipped drafter's recipe")
    p.add_argument("--data-share", type=float, default=0.5, help="run: the regeneration's share of the time left")
    p.add_argument("--skip-samples", type=int, default=0,
                   help="prepare: leave out the first N train-split prompts (6144: only those the shipped drafter "
                        "never saw; default 0: every train-split prompt, more than it saw)")
    return p


def _receive(places: Places) -> int:
    got = receive(carried_folders(places.carry), places.store)
    print(f"gpu_train: received {', '.join(got) or 'nothing'} into {places.store}; make the next call now")
    return 0 if got else 2


def _reassemble(args) -> int:
    if args.returned is None:
        raise ValueError("reassemble: name the folder the window's files came back to")
    dest = reassemble(args.returned, args.to)
    accept = "python scripts/bench_accept.py --num-prompts 200 --max-new-tokens 128 --block-sizes 16 --draft"
    print(f"gpu_train: drafter in {dest}. Held-out tau (eval split), the new one and the shipped one on the "
          f"same machine (ship at +0.3 or more, docs/gpu_train.md):\n  {accept} {dest} --out "
          f"{dest}/accept\n  {accept} {SHIPPED.relative_to(REPO)} --out {dest}/accept_shipped")
    return 0


def _run(places: Places, args, started_s: float) -> int:
    """The last call's window on the CUDA device (not caught: a failure here is the report's, or a traceback)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_train: run needs a CUDA device (`bash scripts/gpu_train.sh --device cpu` rehearses)")
    size = SIZES["cuda"]
    budget = Budget((args.budget_s or size.budget_s) - started_s)
    window = Window("cuda", places, budget, size, args.init, args.data_share, started_s)
    rc = window.run(carried_folders(places.carry))
    print((places.out / "train.md").read_text())
    return rc


def _prepare(places: Places, args) -> int:
    from dflash_sglang.testbed.target import gguf_path
    from dflash_sglang.bench.gpu.wheels import tree_bytes

    manifest = prepare("cuda", places, gguf_path(), tree_bytes(), args.skip_samples)
    g, s = manifest["gguf"], manifest["stream"]
    print(f"gpu_train: {g['name']} {g['bytes'] / MIB:.1f} MiB -> xz {s['bytes'] / MIB:.1f} MiB "
          f"({manifest['calls']} calls; raw it would take {manifest['raw_calls']}); working tree "
          f"{manifest['tree_bytes'] / MIB:.1f} MiB, room per call {manifest['room_bytes'] / MIB:.1f} MiB")
    for folder in carried_folders(places.carry):
        files = ", ".join(f"{f.name} {f.stat().st_size / MIB:.2f} MiB" for f in sorted(folder.iterdir()))
        print(f"  {folder.relative_to(REPO)}: {files}")
    pr = manifest["prompts"]
    print(f"  prompts: {pr['count']} distinct train-split prompts after the first {pr['skip']} ({pr['val']} held out)")
    size = SIZES["cuda"]
    data_s, train_s = split_budget(size.budget_s - size.est["join"] - size.est["convert"], size, 0.5)
    print(f"  plan ({size.budget_s:.0f} s): join ~{size.est['join']:.0f} s, convert ~{size.est['convert']:.0f} s, "
          f"regenerate ~{data_s:.0f} s + start, train ~{train_s:.0f} s + start, pack ~{size.est['pack']:.0f} s")
    print("The calls, back to back (a warm machine keeps the store ~30 s):")
    print("\n".join(f"  {c}" for c in run_calls(manifest, places, size.budget_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
