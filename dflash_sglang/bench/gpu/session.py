"""The GPU session's budgeted stage runner: every stage in order, each timed, its table written the moment it ends.

A lent GPU machine gives 15 minutes in all (docs/gpu_session.md), so one call runs within `--budget-s` (default 510 s,
counted from the call's start, `--started-at`: the install and the import chain are stage 0): a stage starts only if
its smallest useful part (`Stage.min_s`) fits what is left; inside a stage each
cell (an Engine, a test file) checks the budget again, and a stage's optional cells also leave room for the later
stages' smallest parts (`Context.reserve_s`). What is skipped says why, in the table. After every stage (and every cell
a stage publishes) `session.md` and `session.json` in `--out` are rewritten, so a call killed at its timeout still
returns everything done before it; the device returns at most 8 files from $OUT, hence one markdown and one JSON file
for all stages, plus `logs.tar.gz`.

`--device cpu` is the rehearsal CI runs (`bash scripts/gpu_session.sh --device cpu`): the same stages at tiny sizes,
the CUDA-only cells skipped as such. The stages themselves: `gpu_stages.py`; what a stage gets and gives:
`gpu_context.py`.

  python -m dflash_sglang.bench.gpu.session --device cuda --budget-s 510 --out "$OUT"
  python -m dflash_sglang.bench.gpu.session --list     # the plan: each stage's estimates and their running sums
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from dflash_sglang.bench.gpu import stages as gpu_stages
from dflash_sglang.bench.gpu.device import pack_logs, write_whole
from dflash_sglang.bench.gpu.context import Budget, Context, Stage, StageResult, Table
from dflash_sglang.bench.gpu.jit import jit_since

REPO = Path(__file__).resolve().parents[3]
DEVICES = ("cuda", "cpu")
BUDGET_S = 510.0  # the whole call on CUDA (install, import, stages): 8.5 min of a 10-minute call and 15 device minutes


class Session:
    """Runs stages in order under one budget; writes session.md / session.json / logs.tar.gz after each."""

    def __init__(self, stages: list[Stage], ctx: Context):
        self.stages, self.ctx, self.results = stages, ctx, []
        ctx.out.mkdir(parents=True, exist_ok=True)
        ctx.work.mkdir(parents=True, exist_ok=True)

    def run(self) -> list[StageResult]:
        ctx = self.ctx
        for i, stage in enumerate(self.stages):
            ctx.reserve_s = reserve_after(self.stages, i, ctx.device)
            need = stage.min_s.get(ctx.device)
            t0, wall0 = time.monotonic(), time.time()
            if need is None:
                result = StageResult(stage.number, stage.key, stage.title, "skipped", 0.0, 0.0,
                                     f"skipped: needs {'a GPU' if ctx.device == 'cpu' else 'the CPU'}")
            elif not ctx.budget.fits(need):
                result = StageResult(stage.number, stage.key, stage.title, "skipped", 0.0, need,
                                     ctx.budget.skip_reason(need))
            else:
                print(f"=== stage {stage.number} {stage.key}: {stage.title} ({ctx.budget.left():.0f} s left, "
                      f"~{stage.full_s.get(ctx.device, need):.0f} s estimated)", flush=True)
                ctx.publish = lambda table, s=stage, t=t0: self._write(
                    StageResult(s.number, s.key, s.title, "running", time.monotonic() - t, 0.0, "", asdict(table)))
                try:
                    table = stage.run(ctx)
                    result = StageResult(stage.number, stage.key, stage.title, table.status(),
                                         time.monotonic() - t0, stage.full_s.get(ctx.device, need), "",
                                         asdict(table))
                    print(table.markdown(), flush=True)
                except Exception as e:  # a broken stage must not cost the stages after it
                    (ctx.work / f"stage{stage.number}_error.log").write_text(traceback.format_exc())
                    result = StageResult(stage.number, stage.key, stage.title, "error", time.monotonic() - t0,
                                         need, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if result.status != "skipped":
                result.jit = jit_since(wall0).describe()
            self.results.append(result)
            print(f"=== stage {stage.number} {stage.key}: {result.status} in {result.seconds:.0f} s "
                  f"{result.reason} (JIT: {result.jit or '-'})", flush=True)
            self._write()
        return self.results

    def _write(self, running: StageResult | None = None) -> None:
        results = self.results + ([running] if running is not None else [])
        ctx = self.ctx
        head = (f"# GPU session ({ctx.device}, budget {ctx.budget.total_s:.0f} s, {ctx.budget.left():.0f} s left)\n\n"
                f"{verdict_line(results)}\n\n"
                "| stage | status | seconds | estimate | JIT compile | note |\n|---|---|---|---|---|---|\n")
        head += "".join(f"| {r.number} {r.key} | {r.status} | {r.seconds:.0f} | {r.estimate_s:.0f} | {r.jit or '-'} | "
                        f"{r.reason} |\n" for r in results)
        tables = [Table(**r.table).markdown() for r in results if r.table]
        write_whole(ctx.out / "session.md", head + "\n" + "\n\n".join(tables) + "\n")
        write_whole(ctx.out / "session.json", json.dumps({"device": ctx.device, "budget_s": ctx.budget.total_s,
                                                      "stages": [asdict(r) for r in results]}, indent=1))
        pack_logs(ctx.work, ctx.out / "logs.tar.gz")


def exit_code(results: list[StageResult]) -> int:
    """1 if a stage failed or broke, else 0 (skipped stages and measured slowness are reported, not failures)."""
    return int(any(r.status in ("failed", "error") for r in results))


def verdict_line(results: list[StageResult]) -> str:
    """The session's verdict in one line: FAILED (naming the stages) before slower before partial before passed;
    never "passed" while a stage failed, broke or was skipped."""
    def named(*statuses: str) -> str:
        return ", ".join(f"{r.number} {r.key}" for r in results if r.status in statuses)

    if bad := named("failed", "error"):
        return f"**verdict: FAILED** (stages {bad})"
    parts = [f"slower than the builtin in stages {s}" for s in [named("slower")] if s]
    parts += [f"not run in full: stages {s}" for s in [named("skipped", "partial", "empty")] if s]
    return f"**verdict: {'; '.join(parts) or 'passed'}**" if results else "**verdict: nothing ran**"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=DEVICES, default="cuda")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help=f"seconds for the whole call, install and import included (default {BUDGET_S:.0f})")
    p.add_argument("--started-at", type=float, help="the call's start (epoch seconds; gpu_session.sh passes it): the "
                                                    "budget counts from there")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "work_tmp" / "gpu_session"))
    p.add_argument("--work", type=Path, help="scratch and logs (default: OUT/../gpu_session_work on CPU, "
                                             "/tmp/dflash_gpu_session on CUDA)")
    p.add_argument("--wheels", type=Path, help="stage 0 installs this wheel folder (CUDA default: .whl)")
    p.add_argument("--site", type=Path, default=Path("/tmp/dflash_site"), help="where stage 0 installs the wheels")
    p.add_argument("--stages", default="0,1,2,3,4,5", help="comma list of stage numbers, in the order given")
    p.add_argument("--list", action="store_true", help="print the stages, what each decides and the plan's estimates")
    args = p.parse_args(argv)
    stages = gpu_stages.select(args.stages)
    if args.list:
        print(plan_text(stages, args.budget_s))
        return 0
    started_s = max(time.time() - args.started_at, 0.0) if args.started_at else 0.0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_session: --device cuda but torch sees no CUDA device (--device cpu rehearses)")
    work = args.work or (Path("/tmp/dflash_gpu_session") if args.device == "cuda"
                         else args.out.parent / "gpu_session_work")
    wheels = args.wheels or (REPO / ".whl" if args.device == "cuda" else None)
    ctx = Context(args.device, args.out.resolve(), work.resolve(), Budget(args.budget_s - started_s),
                  wheels=wheels.resolve() if wheels else None, site=args.site, started_s=started_s)
    results = Session(stages, ctx).run()
    print((ctx.out / "session.md").read_text().split("\n\n", 1)[1] if (ctx.out / "session.md").exists() else "")
    print(f"gpu_session: {len(results)} stages, session.md / session.json / logs.tar.gz in {ctx.out}", flush=True)
    return exit_code(results)


def reserve_after(stages: list[Stage], i: int, device: str) -> float:
    """The seconds stage i leaves for the stages after it: their smallest parts, optional stages left out."""
    return sum(s.min_s.get(device, 0.0) for s in stages[i + 1:] if not s.optional)


def plan(stages: list[Stage], budget_s: float, device: str) -> list[tuple[Stage, float | None]]:
    """What a session would run by the estimates, as `Session.run` decides: each stage's planned seconds (all of it,
    or what is left beyond the later stages' reserve, but at least its smallest part), None where it is skipped."""
    left, out = budget_s, []
    for i, s in enumerate(stages):
        need = s.min_s.get(device)
        reserve = reserve_after(stages, i, device)
        if need is None or need > left:
            out.append((s, None))
            continue
        spend = min(s.full_s.get(device, need), max(left - reserve, need))
        out.append((s, spend))
        left -= spend
    return out


def plan_text(stages: list[Stage], budget_s: float) -> str:
    """The plan per device: each stage's estimates and what the budget gives it, and where the call ends."""
    lines = []
    for device in DEVICES:
        lines.append(f"{device} (budget {budget_s:.0f} s, counted from the call's start):")
        t = 0.0
        for s, spend in plan(stages, budget_s, device):
            est = (f"~{s.min_s[device]:.0f} s at least, ~{s.full_s.get(device, s.min_s[device]):.0f} s in full"
                   if device in s.min_s else f"needs {'a GPU' if device == 'cpu' else 'the CPU'}")
            t += spend or 0.0
            what = f"planned {spend:.0f} s, ends at {t:.0f} s" if spend is not None else "skipped"
            lines.append(f"  {s.number} {s.key}{' (optional)' if s.optional else ''}: {est}; {what}  ({s.title})")
        lines.append(f"  by the estimates the call ends at {t:.0f} s ({t / 60:.1f} min)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
