"""`dflash-sglang demo` served through SGLang (the default backend): the SmolLM2 testbed pair on CPU `sgl.Engine`s.

Three arms of measure/passes.py, each a CPU Engine (float32, torch_native attention, batch 1) in a child process
of its own: plain decoding, DFLASH with no shape flag (the goodput controller: what a server runs by default) and DFLASH
with a pinned chain of the drafter's block (`--speculative-num-draft-tokens B`). Each Engine starts once, one start-up
at a time (~15-45 s each on a quiet 2-core machine), and is kept for every pass (measure/resident.py: the idle ones
sleep on their sockets, only one decodes at a time). `--repeats` (8) interleaved passes (measure/passes.py
`run_passes`), each asking every arm in turn (plain, controller, chain; the next pass in reverse), so a slow spell of
the machine hits every arm alike; in pass r each Engine decodes a short warm-up, then eval prompt r mod `--num-prompts`
(ShareGPT's eval split with the chat template, as the reference demo) greedily for `--max-new-tokens` (32) tokens, EOS
ignored so that every arm decodes the same count. Each Engine's first warm-up decodes `FIRST_WARMUP_NEW` tokens,
untimed: the controller's start-up exploration ends there, as in a server that has been up a while (its probes stay in
the timed rounds). A pass takes ~20 s, so 8 of them (the interval tightens with each) and the three start-ups keep the
table within ~4-5 minutes.

Reported in a table: each arm's tokens/s over its timed rounds, its ratio to plain (the median of the per-pass ratios)
with a 95% interval and the verdict (measure/spread.py `RatioSpread`: a speedup or slower only when the interval
excludes 1.0), its mean accept length (SGLang's `spec_accept_length`, the bonus token included) and whether its greedy
outputs equal plain's token for token; then what the controller chose, in words, from the shapes it ran (its Engine logs
one debug line per decode step, measure/shape_trace.py); last, the controller's speed against plain in
RatioSpread's words with the pinned chain's beside it. When other processes kept the machine busy before an Engine
started (measure/training_pause.py `busy_share`), the ratios are printed as not measurements. Exit 1 when an output
differs from plain or an Engine fails.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash_sglang.measure.passes import (
    RunSettings, build_plan, cpu_engine_kwargs, ratio_spread, round_id, run_passes, summarize,
)
from dflash_sglang.measure.spread import RatioSpread
from dflash_sglang.measure.shape_trace import TracedStep, logging_config, parse_trace, shape_mix
from .words import BUSY_SHARE, DRAFT_CHOICE, PLAIN_CHOICE, spoken

REPO = Path(__file__).resolve().parents[2]
FIRST_WARMUP_NEW = 48  # tokens of each Engine's first (untimed) warm-up request
BUSY_PROBE_S = 0.5  # the machine's busy share is sampled this long before each arm's round (24 rounds: 12 s in all)


@dataclass(frozen=True)
class ArmReport:
    """One arm's row of the table."""

    label: str
    tok_s: float | None  # tokens / wall seconds over its timed rounds (None: its Engine failed)
    spread: RatioSpread | None  # its per-pass ratios to plain (None: plain itself, or no paired pass)
    accept: float | None  # mean spec_accept_length over its requests (None: plain)
    mismatches: int | None  # requests whose output differs from plain's (None: plain itself, or sampled)
    log: Path | None = None  # where a failed Engine's log is


def unavailable() -> str | None:
    """Why CPU SGLang Engines cannot serve the demo here, in one line; None when they can. Checked without importing
    sglang (that takes ~10 s, and on CPU the import shims): the package is there at a release our adapter serves, and
    triton or the CPU import shims of a source checkout are."""
    if importlib.util.find_spec("sglang") is None:
        py = ".".join(map(str, sys.version_info[:2]))
        return (f"SGLang is not installed in this Python {py}; bash scripts/setup.sh installs it where the Python is "
                f"supported, >= 3.11")
    try:  # the adapter's import checks the installed release is one we serve (metadata only, no sglang import)
        importlib.import_module("dflash_sglang.adapter")
    except ImportError as e:
        return str(e)
    if importlib.util.find_spec("triton") is None and not (REPO / "tests" / "sglang_shims").is_dir():
        return "no triton and no CPU import shims (tests/sglang_shims, in a source checkout)"
    return None


def arms_for(draft: Path, block: int) -> dict[str, dict]:
    """The three arms' Engine kwargs beyond the common ones, in the order every pass runs them."""
    spec = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(draft)}
    return {"plain": {}, "controller": spec, f"chain{block}": {**spec, "speculative_num_draft_tokens": block}}


def choice_words(mix: Counter[str]) -> str:
    """What the controller chose, from its decode steps per shape ('1' a plain step, '4' a chain of 4 rows, '8x4' a
    tree): plain steps when they are at least half, else drafted, naming the shape it ran most."""
    total = sum(mix.values())
    if not total:
        return "no decode step of the controller was logged, so what it chose is not known"
    plain = mix.get("1", 0)
    drafted = Counter({s: n for s, n in mix.items() if s != "1"})
    if 2 * plain >= total:
        rest = ", ".join(f"{spoken(s)} x{n}" for s, n in drafted.most_common())
        return (f"{PLAIN_CHOICE} {plain / total:.0%} of the time ({plain} of {total} decode steps"
                + (f"; drafted: {rest}" if rest else "") + ")")
    top, n = drafted.most_common(1)[0]
    return (f"{DRAFT_CHOICE} {1 - plain / total:.0%} of the time, mostly a {spoken(top)} ({n} of {total} decode "
            f"steps)")


def drafted_words(steps: list[TracedStep], trained_tau: float | None) -> str | None:
    """The controller's drafted steps: their share and the tokens each committed (its accept length where it drafted),
    beside the drafter's held-out tau from its TRAINING.md (None: another drafter); None without logged steps."""
    if not steps:
        return None
    drafted = [s.committed for s in steps if s.nodes > 1]
    where = f"accept length {sum(drafted) / len(drafted):.2f} on those" if drafted else "none drafted"
    trained = "" if trained_tau is None else f" (the drafter's held-out tau, TRAINING.md: {trained_tau:.2f})"
    share = f"{len(drafted)} of {len(steps)} decode steps ({len(drafted) / len(steps):.0%})"
    return f"controller: drafted {share}, {where}{trained}"


def report(plain: ArmReport, controller: ArmReport, chain: ArmReport, mix: Counter[str],
           busy: float | None, drafted: str | None = None) -> tuple[list[str], int]:
    """The table, the controller's choice in words and the headline; the exit status (1: an output differs from plain
    or an Engine failed)."""
    arms = (plain, controller, chain)
    width = max(len(a.label) for a in arms)
    lines = [f"{'':{width}}  {'tok/s':>6}  {'vs plain':>8}  {'95% interval':>12}  {'accept':>6}  "
             f"{'identical':>9}  verdict"]
    for a in arms:
        if a.tok_s is None:
            lines.append(f"{a.label:{width}}  FAILED: its Engine's log is {a.log}")
            continue
        s = a.spread
        ci = "-" if s is None or s.interval is None else "{:.2f}-{:.2f}x".format(*s.interval)
        ratio = "1.00x" if a is plain else "-" if s is None else f"{s.median:.2f}x"
        accept = "-" if a.accept is None else f"{a.accept:.2f}"
        same = "-" if a.mismatches is None else "yes" if a.mismatches == 0 else f"NO ({a.mismatches})"
        verdict = "-" if s is None else s.verdict
        lines.append(f"{a.label:{width}}  {a.tok_s:6.1f}  {ratio:>8}  {ci:>12}  {accept:>6}  {same:>9}  {verdict}")
    lines.append(f"controller: {choice_words(mix)}")
    if drafted is not None:
        lines.append(drafted)
    if controller.spread is None:
        lines.append("=== the controller's speed against plain is not known: an Engine failed")
    elif busy is not None and busy > BUSY_SHARE:
        lines.append(f"=== machine busy: other processes used up to {busy:.0%} of the CPU before an Engine started, so "
                     f"the controller's speed ({controller.spread.median:.2f}x of plain) is not a measurement")
    else:
        pinned = "" if chain.spread is None else f"; {chain.label}: {chain.spread.words()}"
        lines.append(f"=== {controller.label}: {controller.spread.words()}{pinned}")
    bad = sum(a.mismatches or 0 for a in arms)
    if bad:
        lines.append(f"ERROR: {bad} greedy outputs differ from plain decoding")
    return lines, int(bool(bad) or any(a.tok_s is None for a in arms))


class _Progress:
    """One line per pass as its Engines finish: 'pass 1/3: plain 24 s, controller 25 s, chain16 31 s'."""

    def __init__(self, repeats: int) -> None:
        self.repeats, self.current = repeats, None

    def __call__(self, arm: str, seen: dict) -> None:
        k = seen["pass"]
        if k != self.current:
            print(("\n" if self.current is not None else "") + f"pass {k + 1}/{self.repeats}:", end="")
            sep, self.current = " ", k
        else:
            sep = ", "
        took = "FAILED" if seen["failed"] else f"{seen['child_s']:.0f} s"
        print(f"{sep}{arm} {took}", end="", flush=True)

    def close(self) -> None:
        if self.current is not None:
            print(flush=True)


def run(args: argparse.Namespace) -> int:
    from importlib.metadata import version

    from transformers import AutoTokenizer

    from ..core.draft.config import DraftConfig
    from ..testbed import DRAFT_ASSET, DRAFT_TAU, cache_home, convert_target, default_pair
    from ..testbed.data import eval_prompts

    if args.draft is None and args.target is None:
        args.target, args.draft = default_pair()
    draft, target = args.draft or DRAFT_ASSET, args.target or convert_target()
    block = args.block_size or DraftConfig.load(draft).block_size
    if block < 2:
        raise ValueError(f"--block-size must be >= 2, got {block}")
    out = Path(args.out or cache_home() / "demo")
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [list(p.ids) for p in eval_prompts(tok, args.num_prompts)]
    plan = build_plan("eval", [1], args.repeats, prompts, [])
    # The first warm-up is long enough for the controller's start-up exploration (its warm-up shapes, a few steps
    # each): a server a user looks at has done that long before; its probes stay in the timed rounds
    plan[0]["new_tokens"] = FIRST_WARMUP_NEW
    arms = arms_for(draft, block)
    env = {"SGLANG_LOGGING_CONFIG_PATH": str(logging_config(out / "trace_logging.json"))}  # the controller's steps
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    settings = RunSettings(out=out, new_tokens=args.max_new_tokens, repeats=args.repeats,
                           sampling=[f"temperature={args.temperature}"], env=env, resident=True)
    greedy = args.temperature == 0
    print(f"dflash-sglang demo: SGLang {version('sglang')}, CPU Engines (float32, torch_native attention), batch 1, "
          f"{'greedy' if greedy else f'temperature {args.temperature}'}; target {target.name}, drafter {draft.name} "
          f"(block {block})")
    print(f"{args.repeats} repeats x {args.max_new_tokens} tokens over {len(prompts)} ShareGPT eval prompts: a "
          f"{', '.join(arms)} Engine started once each, one at a time (~15-45 s each), then every repeat asks each in "
          f"turn; logs in {out}", flush=True)
    progress = _Progress(args.repeats)
    with open(out / "demo.log", "w") as log:
        results, info = run_passes(arms, plan, settings, cpu_engine_kwargs(target, plan, args.max_new_tokens, 1),
                                   busy_probe_s=BUSY_PROBE_S, say=lambda line: print(line, file=log, flush=True),
                                   on_engine=progress)
    progress.close()
    rows = {r["arm"]: r for r in summarize(plan, results)}  # (one group: batch 1)
    timed = [s for s in plan if not s.get("warmup")]
    by_arm = {a: {round_id(r): r for r in res["rounds"]} for a, res in results.items() if res is not None}
    labels = {"plain": "plain", "controller": "DFLASH, no shape flag (the controller)",
              f"chain{block}": f"DFLASH, pinned chain of {block}"}

    def arm_report(name: str) -> ArmReport:
        row = rows.get(name)
        if row is None:
            log = next((p["log"] for p in info[name]["passes"] if p["failed"]), None)
            return ArmReport(labels[name], None, None, None, None, None if log is None else Path(log))
        spread = None if name == "plain" or "plain" not in by_arm else ratio_spread(timed, by_arm[name],
                                                                                    by_arm["plain"])
        same = row["mismatches"] if greedy and name != "plain" else None
        return ArmReport(labels[name], row["tok_s"], spread, row["accept_mean"], same)

    logs = dict.fromkeys(p["log"] for p in info["controller"]["passes"] if not p["failed"])  # (resident: one)
    steps = [s for log in logs for s in parse_trace(Path(log).read_text())]
    busy = max((p["busy_share_before"] for a in info.values() for p in a["passes"]
                if p["busy_share_before"] is not None), default=None)
    tau = DRAFT_TAU if Path(draft).resolve() == DRAFT_ASSET.resolve() else None
    lines, status = report(*(arm_report(name) for name in arms), shape_mix(steps), busy, drafted_words(steps, tau))
    print("\n" + "\n".join(lines))
    return status
