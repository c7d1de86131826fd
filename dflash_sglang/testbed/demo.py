"""`dflash-sglang demo`: speculative decoding on the SmolLM2 testbed, on CPU, with the core reference decoder.

Sets up the target (converting the packaged GGUF on first use), loads the shipped drafter, and decodes a few held-out
ShareGPT prompts one at a time three ways: plainly, with a fixed chain of the drafter's block every step (no
controller), and with the goodput controller (core/goodput.py, the server's default: each step's chain or tree, a
chain of 1 = a plain step, from measured acceptance and step cost). One controller serves the warm-up and every
prompt, as in a server, so it learns over the run. Prints per prompt the text, tokens/s of each way, tau, the
controller's shapes and where a step's time goes (drafter pass / target verify / the rest); then a table of the three
(tokens/s, ratio to plain, tau), what the controller chose and why, and the headline: the controller's speedup over
plain (the product's speed; a fixed chain slower than plain is only a row of the table). Greedy outputs must equal
plain output token for token. Other processes' CPU use during the timed runs is measured (/proc/stat): when it is
large, the ratio is printed as not meaningful instead of as a result.
"""
from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.goodput import DEFAULT_TREE_TOPK, Decision, GoodputConfig, GoodputController, describe

BUSY_SHARE = 0.15  # other processes' share of the machine's CPU above which timings are not reported as results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=None, help="HF target dir (default: the testbed target)")
    p.add_argument("--draft", type=Path, default=None, help="draft dir (default: the shipped testbed drafter)")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None)


@dataclass
class CpuMeter:
    """Wall time, this process's CPU time and the whole machine's busy CPU time over a block (Linux /proc/stat;
    elsewhere the machine's share is unknown)."""

    wall: float = 0.0
    own_cpu: float = 0.0
    machine_cpu: float | None = 0.0

    def __enter__(self) -> CpuMeter:
        self._t, self._own, self._machine = time.perf_counter(), time.process_time(), _machine_busy_s()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._t
        self.own_cpu += time.process_time() - self._own
        end = _machine_busy_s()
        if self.machine_cpu is None or end is None or self._machine is None:
            self.machine_cpu = None
        else:
            self.machine_cpu += end - self._machine

    def others_share(self) -> float | None:
        """Other processes' CPU time as a share of the machine's capacity over the measured wall time."""
        if self.machine_cpu is None or self.wall <= 0:
            return None
        return max(self.machine_cpu - self.own_cpu, 0.0) / (self.wall * (os.cpu_count() or 1))


def _machine_busy_s() -> float | None:
    """Seconds of busy CPU (every state but idle and iowait) summed over all CPUs since boot, or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CountingController(GoodputController):
    """The goodput controller, also counting its decisions by reason (warmup / best / probe) for the demo's report."""

    def __init__(self, cfg: GoodputConfig) -> None:
        super().__init__(cfg)
        self.reasons: Counter[str] = Counter()

    def choose(self, bs: int) -> Decision:
        decision = super().choose(bs)
        self.reasons[decision.reason] += 1
        return decision


def controller_verdict(summary: dict, reasons: Counter | None = None) -> str:
    """One line: what the goodput controller chose over the run and why, from its `summary` (core/goodput.py) and,
    when known, its decisions by reason."""
    steps = summary["steps"]
    total = sum(steps.values())
    pred = summary.get("predicted_tps")
    drafted = {s: g for s, g in (pred or {}).items() if s != "1"}
    if not pred or not drafted or not total:
        return f"controller: {describe(summary)}"
    best = summary["best"]
    top = max(drafted, key=drafted.get)
    plain_share = steps.get("1", 0) / total
    how = "" if reasons is None else (f"; {reasons['warmup']} warm-up steps (longest chain, plain, middle chain), "
                                      f"{reasons['probe']} probes of a longer chain")
    if best == "1":
        why = (f"drafting does not pay on this machine with this drafter: a plain step is predicted {pred['1']} "
               f"tok/s, the best drafted shape (a {spoken(top)}) {drafted[top]} tok/s, so it ran plain steps "
               f"({plain_share:.0%} of its {total} steps{how})")
    else:
        why = (f"drafting pays: a {spoken(best)} is predicted {pred[best]} tok/s vs plain {pred['1']} tok/s, so "
               f"{1 - plain_share:.0%} of its {total} steps drafted{how}")
    return f"controller: {why} ({describe(summary)})"


def spoken(shape: str) -> str:
    """'4' -> 'chain of 4 rows', '8x4' -> 'tree of 8 nodes over top-4' (core/goodput.py `label`)."""
    nodes, _, topk = shape.partition("x")
    return f"tree of {nodes} nodes over top-{topk}" if topk else f"chain of {nodes} rows"


def _step_split(times) -> str:
    per = 1e3 / max(times.steps, 1)
    return (f"per step {times.total * per:.0f} ms = draft {times.draft * per:.0f} + verify {times.verify * per:.0f} + "
            f"rest {times.other * per:.0f}")


def run(args: argparse.Namespace) -> int:
    from ..core.checkpoint import load_drafter
    from ..core.reference import ReferenceDecoder, StepTimes
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
    # one for the whole run, as in a server
    controller = CountingController(GoodputConfig(max_nodes=block, max_depth=block - 1, max_topk=DEFAULT_TREE_TOPK))
    eos = tok.eos_token_id
    kw = dict(temperature=args.temperature, eos_token_id=eos)
    prompts = eval_prompts(tok, args.num_prompts)
    warm = [list(prompts[0].ids)]
    decoder.generate(warm, 4, block_size=block, **kw)  # warm-up (first-call allocations), untimed
    decoder.generate(warm, 4, block_size=block, controller=controller, **kw)  # the controller's first steps
    fixed_name = f"fixed block {block} (no controller)"
    ways = ("plain", "fixed", "controller")
    meters = {w: CpuMeter() for w in ways}
    tokens = dict.fromkeys(ways, 0)
    taus: dict[str, list[float]] = {"fixed": [], "controller": []}
    mismatches = 0
    for i, p in enumerate(prompts):
        ids = [list(p.ids)]
        with meters["plain"]:
            t = time.perf_counter()
            (plain,) = decoder.plain_generate(ids, args.max_new_tokens, **kw)
            dt_p = time.perf_counter() - t
        fixed_times, ctrl_times = StepTimes(), StepTimes()
        with meters["fixed"]:
            t = time.perf_counter()
            (fixed,) = decoder.generate(ids, args.max_new_tokens, block_size=block, times=fixed_times, **kw)
            dt_f = time.perf_counter() - t
        before = dict(controller.counts)
        with meters["controller"]:
            t = time.perf_counter()
            (gen,) = decoder.generate(ids, args.max_new_tokens, block_size=block, times=ctrl_times,
                                      controller=controller, **kw)
            dt_c = time.perf_counter() - t
        chosen = controller.steps_since(before)
        for way, out in (("plain", plain), ("fixed", fixed.tokens), ("controller", gen.tokens)):
            tokens[way] += len(out)
        taus["fixed"].append(fixed.mean_accept_length)
        taus["controller"].append(gen.mean_accept_length)
        greedy = args.temperature == 0
        mismatches += greedy * ((fixed.tokens != plain) + (gen.tokens != plain))

        def same(out) -> str:
            return f"; identical to plain: {out.tokens == plain}]" if greedy else "]"

        print(f"--- prompt {i} ({p.conv_id}): {p.text[:100]!r}")
        print(tok.decode(gen.tokens, skip_special_tokens=True))
        print(f"[plain: {len(plain) / dt_p:.1f} tok/s, {len(plain)} tokens]")
        print(f"[{fixed_name}: tau {fixed.mean_accept_length:.2f} over {len(fixed.accept_lengths)} steps, "
              f"{len(fixed.tokens) / dt_f:.1f} tok/s; {_step_split(fixed_times)}" + same(fixed))
        print(f"[goodput controller: tau {gen.mean_accept_length:.2f} over {len(gen.accept_lengths)} steps, "
              f"{len(gen.tokens) / dt_c:.1f} tok/s; steps per shape {chosen}; {_step_split(ctrl_times)}"
              + same(gen))
    tps = {w: tokens[w] / meters[w].wall for w in ways}
    tau = {w: sum(v) / len(v) for w, v in taus.items()}
    ratio = tps["controller"] / tps["plain"]
    shares = [s for s in (m.others_share() for m in meters.values()) if s is not None]
    busy = bool(shares) and max(shares) > BUSY_SHARE
    setting = (f"CPU, batch 1, {torch.get_num_threads()} threads, {len(prompts)} prompts x up to "
               f"{args.max_new_tokens} tokens")
    print(f"=== block {block}, temperature {args.temperature} ({setting})"
          + ("; the machine was busy, so the tok/s below are not measurements" if busy else ""))
    width = len(fixed_name)
    print(f"{'':{width}}  {'tok/s':>8}  {'vs plain':>8}  {'tau':>5}")
    for way, name in (("plain", "plain"), ("fixed", fixed_name), ("controller", "goodput controller")):
        print(f"{name:{width}}  {tps[way]:8.1f}  {tps[way] / tps['plain']:7.2f}x  "
              + (f"{tau[way]:5.2f}" if way in tau else f"{'-':>5}"))
    print(controller_verdict(controller.summary(1), controller.reasons))
    if busy:
        print(f"=== mean tau {tau['controller']:.2f}; machine busy: other processes used {max(shares):.0%} of the CPU "
              f"while timing, so the speed ratio ({ratio:.2f}x) is not a measurement of this decoder")
    else:
        print(f"=== block {block}, temperature {args.temperature}: mean tau {tau['controller']:.2f}; speedup "
              f"{ratio:.2f}x with the goodput controller ({tps['controller']:.1f} vs plain {tps['plain']:.1f} tok/s; "
              f"{setting})")
    if mismatches:
        print(f"ERROR: {mismatches} greedy outputs differ from plain decoding")
        return 1
    return 0
