"""`dflash-sglang demo`: speculative decoding on the SmolLM2 testbed, on CPU. By default served through SGLang
(`--backend sglang`, demo/engines.py: CPU Engines, one at a time); where SGLang cannot run, or with
`--backend reference`, with the core reference decoder in this process, as below.

The reference backend sets up the target (converting the packaged GGUF on first use), loads the shipped drafter, and
decodes held-out ShareGPT prompts one at a time three ways: plainly, with a fixed chain of the drafter's block every
step (no controller), and with the goodput controller (core/shape/goodput.py, the server's default: each step's chain or
tree, a chain of 1 = a plain step, from measured acceptance and step cost). One controller serves the warm-up and
every decode, as in a server, so it learns over the run.

What is repeated: `--repeats` (6) repeats, repeat r decoding prompt r mod `--num-prompts` (3) for up to
`--max-new-tokens` (48) tokens with each way in turn (plain, fixed, controller, plain, fixed, controller, ...), so a
slow spell of the shared machine hits all three alike; 6 x 48 tokens per way is the work of the 3 x 96 timed once each
before (52 s in all on a quiet 2-core machine, target set up). A single timing of each way is noise as often as speed
(two runs minutes apart printed 1.09x and 0.85x while the controller ran plain steps 93% of the time), so each way's
speed is the median of its per-repeat ratios to plain with a 95% interval (measure/passes.py `RatioSpread`), and
is called a speedup or slower only when that interval excludes 1.0, else "same as plain within noise".

Prints per repeat tokens/s of each way, tau, the controller's shapes and where a step's time goes (drafter pass /
target verify / the rest), and each prompt's text once; then what the controller chose and why, first, a table of
the three (tokens/s median and per-repeat range, ratio to plain with its interval and verdict, tau), and the
headline: the controller's choice and the product's speed against plain (a fixed chain slower than plain is only a
row of the table). Greedy outputs must equal plain output token for token. Other processes' CPU use during the timed
runs is measured (/proc/stat): when it is large, the ratio is printed as not a measurement instead of as a result.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_sglang.measure.spread import RatioSpread
from ..core.shape.goodput import DEFAULT_TREE_TOPK, Decision, GoodputConfig, GoodputController
from .words import BUSY_SHARE, controller_choice, controller_verdict

BACKENDS = ("sglang", "reference")
# (repeats, max new tokens) when not given: the reference decoder's 6 x 48 (52 s of decoding on a quiet 2-core machine);
# SGLang's 8 x 32 on Engines started once each (~20 s a pass after the start-ups, demo/engines.py)
DEFAULTS = {"reference": (6, 48), "sglang": (8, 32)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="sglang",
                   help="sglang (default): CPU SGLang Engines, one at a time, plain / DFLASH with no shape flag (the "
                        "controller) / a pinned chain; reference: the core reference decoder in this process (also "
                        "what runs where SGLang cannot)")
    p.add_argument("--target", type=Path, default=None, help="HF target dir (default: the testbed target)")
    p.add_argument("--draft", type=Path, default=None, help="draft dir (default: the shipped testbed drafter)")
    p.add_argument("--num-prompts", type=int, default=3, help="eval prompts the repeats cycle through")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per repeat and way (default: sglang 32, every arm decoding all 32; reference 48, up to EOS)")
    p.add_argument("--repeats", type=int, default=None,
                   help="each decodes the next prompt (cycling) with every way in turn (sglang: each way's Engine "
                        "started once and kept); the speed ratios' median and 95%% interval come from them (default: "
                        "sglang 8, reference 6)")
    p.add_argument("--block-size", type=int, default=None,
                   help="the fixed / pinned chain's rows (default: the drafter's block)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None,
                   help="reference: torch threads; sglang: OpenMP threads per Engine process (default 1)")
    p.add_argument("--out", type=Path, default=None,
                   help="sglang: each Engine's job, result and log (default: $DFLASH_SGLANG_HOME/demo)")


def run(args: argparse.Namespace) -> int:
    """The chosen backend; SGLang where it can run, else one line saying why and the reference decoder."""
    if (args.repeats is not None and args.repeats < 1) or args.num_prompts < 1:
        raise ValueError("--repeats and --num-prompts must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    backend = args.backend
    if backend == "sglang":
        from . import engines

        why = engines.unavailable()
        if why is not None:
            print(f"demo: SGLang cannot run here ({why}); running the reference decoder instead (--backend reference)",
                  flush=True)
            backend = "reference"
    repeats, tokens = DEFAULTS[backend]
    args.repeats = args.repeats or repeats
    args.max_new_tokens = args.max_new_tokens or tokens
    if backend == "sglang":
        return engines.run(args)
    return run_reference(args)


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


def _step_split(times) -> str:
    per = 1e3 / max(times.steps, 1)
    return (f"per step {times.total * per:.0f} ms = draft {times.draft * per:.0f} + verify {times.verify * per:.0f} + "
            f"rest {times.other * per:.0f}")


WAYS = ("plain", "fixed", "controller")  # the decode order within every repeat


@dataclass
class Way:
    """One way of decoding over the run: per repeat its tokens/s and tau, and the CPU meter of its timed decodes."""

    name: str  # as printed in the table
    tps: list[float] = field(default_factory=list)  # [repeats] tokens / wall seconds of the repeat's decode
    taus: list[float] = field(default_factory=list)  # [repeats] mean accept length (empty for plain)
    meter: CpuMeter = field(default_factory=CpuMeter)

    def row(self, spread: RatioSpread | None, width: int) -> str:
        """Its table row: median tok/s and per-repeat range, ratio to plain with its 95% interval, tau, verdict."""
        tps = f"{statistics.median(self.tps):7.1f}  {min(self.tps):6.1f}-{max(self.tps):<6.1f}"
        tau = f"{statistics.fmean(self.taus):5.2f}" if self.taus else f"{'-':>5}"
        if spread is None:  # plain itself
            return f"{self.name:{width}}  {tps}  {1:7.2f}x  {'-':>12}  {tau}  -"
        ci = spread.interval
        interval = "-" if ci is None else f"{ci[0]:.2f}-{ci[1]:.2f}x"
        return f"{self.name:{width}}  {tps}  {spread.median:7.2f}x  {interval:>12}  {tau}  {spread.verdict}"


def run_reference(args: argparse.Namespace) -> int:
    from ..core.draft.checkpoint import load_drafter
    from ..core.reference import ReferenceDecoder, StepTimes
    from ..testbed import DRAFT_ASSET, convert_target, default_pair
    from ..testbed.data import eval_prompts
    from ..testbed.target import load_target

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
    kw = dict(temperature=args.temperature, eos_token_id=tok.eos_token_id)
    prompts = eval_prompts(tok, args.num_prompts)
    warm = [list(prompts[0].ids)]
    decoder.generate(warm, 4, block_size=block, **kw)  # warm-up (first-call allocations), untimed
    decoder.generate(warm, 4, block_size=block, controller=controller, **kw)  # the controller's first steps
    ways = {"plain": Way("plain"), "fixed": Way(f"fixed block {block} (no controller)"),
            "controller": Way("goodput controller")}
    greedy = args.temperature == 0
    mismatches = 0
    for r in range(args.repeats):
        i = r % len(prompts)
        p, ids = prompts[i], [list(prompts[i].ids)]
        runs = {}
        for way in WAYS:  # interleaved: every repeat decodes the three ways in turn
            times, before = StepTimes(), dict(controller.counts)
            spec = {} if way == "plain" else dict(block_size=block, times=times,
                                                  controller=controller if way == "controller" else None)
            with ways[way].meter:
                t = time.perf_counter()
                if way == "plain":
                    (out,) = decoder.plain_generate(ids, args.max_new_tokens, **kw)
                else:
                    (out,) = decoder.generate(ids, args.max_new_tokens, **spec, **kw)
                dt = time.perf_counter() - t
            tokens = out if way == "plain" else out.tokens
            ways[way].tps.append(len(tokens) / dt)
            if way != "plain":
                ways[way].taus.append(out.mean_accept_length)
            runs[way] = (out, times, controller.steps_since(before))
        plain = runs["plain"][0]
        mismatches += greedy * sum(runs[w][0].tokens != plain for w in ("fixed", "controller"))
        _print_repeat(r, i, p, tok, ways, runs, first=r < len(prompts), greedy=greedy)
    return _print_summary(args, block, len(prompts), ways, controller, mismatches)


def _print_repeat(r: int, i: int, prompt, tok, ways: dict[str, Way], runs: dict, first: bool, greedy: bool) -> None:
    """A repeat's lines: its prompt (with the controller's text the first time), then each way's speed and steps."""
    plain = runs["plain"][0]
    print(f"--- repeat {r}: prompt {i} ({prompt.conv_id}): {prompt.text[:100]!r}")
    if first:
        print(tok.decode(runs["controller"][0].tokens, skip_special_tokens=True))
    print(f"[plain: {ways['plain'].tps[-1]:.1f} tok/s, {len(plain)} tokens]")
    for way in ("fixed", "controller"):
        out, times, chosen = runs[way]
        shapes = f"; steps per shape {chosen}" if way == "controller" else ""
        same = f"; identical to plain: {out.tokens == plain}]" if greedy else "]"
        label = "goodput controller" if way == "controller" else ways[way].name
        print(f"[{label}: tau {out.mean_accept_length:.2f} over {len(out.accept_lengths)} steps, "
              f"{ways[way].tps[-1]:.1f} tok/s{shapes}; {_step_split(times)}" + same)


def _print_summary(args: argparse.Namespace, block: int, n_prompts: int, ways: dict[str, Way],
                   controller: CountingController, mismatches: int) -> int:
    """What the controller chose, first; the table of the three ways; the headline (last line). The exit status."""
    spreads = {w: RatioSpread.paired(ways[w].tps, ways["plain"].tps) for w in ("fixed", "controller")}
    shares = [s for s in (way.meter.others_share() for way in ways.values()) if s is not None]
    busy = bool(shares) and max(shares) > BUSY_SHARE
    summary = controller.summary(1)
    setting = (f"CPU, batch 1, {torch.get_num_threads()} threads; {args.repeats} repeats x up to "
               f"{args.max_new_tokens} tokens over {n_prompts} prompts, each repeat plain, fixed, controller in turn")
    print(f"=== block {block}, temperature {args.temperature} ({setting})"
          + ("; the machine was busy, so the tok/s below are not measurements" if busy else ""))
    print(controller_verdict(summary, controller.reasons))
    width = len(ways["fixed"].name)
    print(f"{'':{width}}  {'tok/s':>7}  {'per repeat':^13}  {'vs plain':>8}  {'95% interval':>12}  {'tau':>5}  "
          f"verdict")
    print(ways["plain"].row(None, width))
    for w in ("fixed", "controller"):
        print(ways[w].row(spreads[w], width))
    ctrl = spreads["controller"]
    tau = statistics.fmean(ways["controller"].taus)
    head = f"=== block {block}, temperature {args.temperature}, goodput controller: {controller_choice(summary)}"
    if busy:
        print(f"{head}; machine busy: other processes used {max(shares):.0%} of the CPU while timing, so its speed "
              f"({ctrl.median:.2f}x of plain) is not a measurement of this decoder; mean tau {tau:.2f}")
    else:
        print(f"{head}; {ctrl.words()}; {statistics.median(ways['controller'].tps):.1f} vs plain "
              f"{statistics.median(ways['plain'].tps):.1f} tok/s (medians); mean tau {tau:.2f}")
    if mismatches:
        print(f"ERROR: {mismatches} greedy outputs differ from plain decoding")
        return 1
    return 0
