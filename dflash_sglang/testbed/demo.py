"""`dflash-sglang demo`: speculative decoding on the SmolLM2 testbed, on CPU, with the core reference decoder.

Sets up the target (converting the packaged GGUF on first use), loads the shipped drafter, and decodes a few
held-out ShareGPT prompts one at a time, both speculatively and plainly. Prints per prompt the text, tau, tokens/s
both ways and where a speculative step's time goes (drafter pass / target verify / the rest), then the speedup
(speculative over plain tokens/s: > 1 means speculation was faster), and checks that greedy speculative output
equals plain output token for token. Other processes' CPU use during the timed runs is measured (/proc/stat): when
it is large, the ratio is printed as not meaningful instead of as a result.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

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
    eos = tok.eos_token_id
    kw = dict(temperature=args.temperature, eos_token_id=eos)
    prompts = eval_prompts(tok, args.num_prompts)
    decoder.generate([list(prompts[0].ids)], 4, block_size=block, **kw)  # warm-up (first-call allocations)
    spec_meter, plain_meter = CpuMeter(), CpuMeter()
    taus, mismatches, n_spec, n_plain = [], 0, 0, 0
    for i, p in enumerate(prompts):
        times = StepTimes()
        with spec_meter:
            t = time.perf_counter()
            (gen,) = decoder.generate([list(p.ids)], args.max_new_tokens, block_size=block, times=times, **kw)
            dt_s = time.perf_counter() - t
        with plain_meter:
            t = time.perf_counter()
            (plain,) = decoder.plain_generate([list(p.ids)], args.max_new_tokens, **kw)
            dt_p = time.perf_counter() - t
        n_spec, n_plain = n_spec + len(gen.tokens), n_plain + len(plain)
        taus.append(gen.mean_accept_length)
        same = gen.tokens == plain
        mismatches += args.temperature == 0 and not same
        per_step = 1e3 / max(times.steps, 1)
        print(f"--- prompt {i} ({p.conv_id}): {p.text[:100]!r}")
        print(tok.decode(gen.tokens, skip_special_tokens=True))
        print(f"[tau {gen.mean_accept_length:.2f} over {len(gen.accept_lengths)} steps, {len(gen.tokens)} tokens; "
              f"spec {len(gen.tokens) / dt_s:.1f} tok/s vs plain {len(plain) / dt_p:.1f} tok/s; per step "
              f"{times.total * per_step:.0f} ms = draft {times.draft * per_step:.0f} + verify "
              f"{times.verify * per_step:.0f} + rest {times.other * per_step:.0f}"
              + (f"; identical to plain: {same}]" if args.temperature == 0 else "]"))
    ratio = (n_spec / spec_meter.wall) / (n_plain / plain_meter.wall)
    tau = sum(taus) / len(taus)
    summary = (f"=== block {block}, temperature {args.temperature}: mean tau {tau:.2f}; speedup {ratio:.2f}x "
               f"(speculative {n_spec / spec_meter.wall:.1f} vs plain {n_plain / plain_meter.wall:.1f} tok/s; CPU, "
               f"batch 1, {torch.get_num_threads()} threads)")
    shares = [s for s in (spec_meter.others_share(), plain_meter.others_share()) if s is not None]
    if shares and max(shares) > BUSY_SHARE:
        summary = (f"=== mean tau {tau:.2f}; machine busy: other processes used {max(shares):.0%} of the CPU while "
                   f"timing, so the speed ratio ({ratio:.2f}x) is not a measurement of this decoder")
    print(summary)
    if mismatches:
        print(f"ERROR: {mismatches} greedy outputs differ from plain decoding")
        return 1
    return 0
