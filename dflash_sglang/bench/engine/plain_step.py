"""What a plain step under the goodput controller costs against a plain decoding step, in the reference decoder.

Where drafting does not pay, the controller runs plain steps (one verify row, no drafter pass): it promises to be no
slower than plain decoding by more than its probes. A plain step under it still pays what a plain decoding step does
not: the controller's bookkeeping, the verify's feature capture, acceptance, and the drafter's upkeep (its context
K/V of the new token). This benchmark isolates that cost on the testbed pair (SmolLM2-135M + the shipped drafter):

- `plain`: `ReferenceDecoder.plain_generate`;
- `controller`: `generate` under a real goodput controller whose step cost (`FixedStepCost`) prices every drafter
  pass out, so after its warm-up (an untimed round) every step is a plain step with the controller's full
  bookkeeping; the drafter's upkeep deferred (core/reference.py `defer_plain_upkeep`, the default);
- `controller_eager`: the same with the upkeep at every step (the behaviour before the deferral).

Repeats are interleaved (each repeat decodes the same prompts with every arm in turn), so a slow spell of the shared
machine hits all arms alike; each arm's speed is the median of its per-repeat ratios to plain with a 95% interval
(measure/spread.py `RatioSpread`). Where the time went: the controller arms' steps split into the target verify and
the rest (acceptance, upkeep, bookkeeping), against plain decoding's per-token time. Greedy outputs must equal plain's.
The last stdout line is JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

from dflash_sglang.core.reference import ReferenceDecoder, StepTimes
from dflash_sglang.core.shape.goodput import FixedStepCost, GoodputConfig, GoodputController
from dflash_sglang.measure.spread import RatioSpread
from dflash_sglang.measure.training_pause import busy_share, cpu_model, training_paused

# Seconds per cost term (core/shape/goodput.py TERMS): a drafter pass costs a second, so no drafted shape ever pays and
# every step after the warm-up is a plain step; the plain terms only scale the controller's numbers.
PRICED_OUT = FixedStepCost((0.0, 0.05, 0.05, 1.0, 0.05, 0.05))
ARMS = ("plain", "controller", "controller_eager")


@dataclass
class ArmTimes:
    """One arm's timed rounds at one concurrency: wall seconds and tokens per round, and the steps' split."""

    walls: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    steps: StepTimes = field(default_factory=StepTimes)

    @property
    def tok_s(self) -> float:
        return sum(self.tokens) / sum(self.walls)


def controller_for(block: int) -> GoodputController:
    return GoodputController(GoodputConfig(max_nodes=block, max_depth=block - 1))


def run(decoder: ReferenceDecoder, prompts: list[list[int]], new_tokens: int, repeats: int,
        concurrency: list[int]) -> dict[int, dict[str, ArmTimes]]:
    """Per concurrency c: each arm's timed rounds over prompts[r*c : (r+1)*c] (cycling), repeats interleaved."""
    block = decoder.cfg.block_size
    out: dict[int, dict[str, ArmTimes]] = {}
    for c in concurrency:
        arms = {a: ArmTimes() for a in ARMS}
        controllers = {a: controller_for(block) for a in ARMS[1:]}
        warm = prompts[:c]
        for arm, ctrl in controllers.items():  # the warm-up (chains of 16, 1 and 8 rows): untimed, as in a server
            _generate(decoder, arm, ctrl, warm, new_tokens, None)
        for r in range(repeats):
            batch = [prompts[(r * c + i) % len(prompts)] for i in range(c)]
            reference = None
            for arm in ARMS:
                t0 = time.perf_counter()
                tokens = _generate(decoder, arm, controllers.get(arm), batch, new_tokens, arms[arm].steps)
                arms[arm].walls.append(time.perf_counter() - t0)
                arms[arm].tokens.append(sum(map(len, tokens)))
                reference = tokens if reference is None else reference
                if tokens != reference:
                    raise AssertionError(f"{arm} at c={c}: output differs from plain decoding (lossless broken)")
        for arm, ctrl in controllers.items():
            drafted = {k: v for k, v in ctrl.steps_since({}).items() if k != "1"}
            assert sum(drafted.values()) <= 2 * ctrl.cfg.warmup_per_shape, f"{arm} drafted after its warm-up"
        out[c] = arms
    return out


def _generate(decoder: ReferenceDecoder, arm: str, ctrl: GoodputController | None, batch: list[list[int]],
              new_tokens: int, times: StepTimes | None) -> list[list[int]]:
    if arm == "plain":
        return decoder.plain_generate(batch, max_new_tokens=new_tokens)
    decoder.defer_plain_upkeep = arm == "controller"
    try:
        outs = decoder.generate(batch, max_new_tokens=new_tokens, controller=ctrl, step_cost=PRICED_OUT, times=times)
    finally:
        decoder.defer_plain_upkeep = ReferenceDecoder.defer_plain_upkeep
    return [o.tokens for o in outs]


def report(results: dict[int, dict[str, ArmTimes]]) -> list[dict]:
    rows = []
    for c, arms in results.items():
        plain = arms["plain"]
        for arm, t in arms.items():
            row = {"c": c, "arm": arm, "tok_s": round(t.tok_s, 2),
                   "ms_per_token": round(1e3 * sum(t.walls) / sum(t.tokens) * c, 1)}
            if arm != "plain":
                spread = RatioSpread.paired([n / w for n, w in zip(t.tokens, t.walls)],
                                            [n / w for n, w in zip(plain.tokens, plain.walls)])
                row.update(ratio=round(spread.median, 3), ci95=list(spread.interval or ()) or None,
                           per_repeat=[round(min(spread.ratios), 3), round(max(spread.ratios), 3)],
                           verdict=spread.words())
                s = t.steps
                if s.steps:
                    row.update(verify_ms=round(1e3 * s.verify / s.steps, 1), other_ms=round(1e3 * s.other / s.steps, 1),
                               draft_ms=round(1e3 * s.draft / s.steps, 2))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.testbed import default_pair
    from dflash_sglang.testbed.data import eval_prompts

    target_dir, draft_dir = default_pair()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    decoder = ReferenceDecoder(target, load_drafter(draft_dir, dtype=torch.float32))
    concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = [list(x.ids) for x in eval_prompts(AutoTokenizer.from_pretrained(target_dir),
                                                 max(concurrency) * args.repeats)]
    print(f"machine: {cpu_model()}, busy {busy_share():.0%} before the run; {args.repeats} interleaved repeats, "
          f"{args.new_tokens} new tokens per request")
    with training_paused():
        results = run(decoder, prompts, args.new_tokens, args.repeats, concurrency)
    rows = report(results)
    print(f"{'c':>3} {'arm':<17}{'tok/s':>8}{'ms/tok':>8}{'vs plain':>9}{'95% interval':>15}{'verify':>8}{'rest':>7}"
          f"  verdict")
    for r in rows:
        ci = "{:.2f}-{:.2f}x".format(*r["ci95"]) if r.get("ci95") else "-"
        print(f"{r['c']:>3} {r['arm']:<17}{r['tok_s']:>8}{r['ms_per_token']:>8}{r.get('ratio', '-'):>9}{ci:>15}"
              f"{r.get('verify_ms', '-'):>8}{r.get('other_ms', '-'):>7}  {r.get('verdict', '-')}")
    print(json.dumps({"rows": rows, "machine": cpu_model(), "repeats": args.repeats, "new_tokens": args.new_tokens,
                      "median_plain_ms_per_token": {c: statistics.median(
                          1e3 * w / n * c for w, n in zip(a["plain"].walls, a["plain"].tokens))
                          for c, a in results.items()}}))
    return 0
