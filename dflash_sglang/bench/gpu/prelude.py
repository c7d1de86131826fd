"""Stage 0 of the GPU session: what comes before any stage can run, inside the same budget.

- `started`: the seconds between the call's start (scripts/gpu_session.sh's first line) and the session's clock (the
  interpreter, torch's import): they count against the budget like any stage.
- `install`: the carried wheels (`--wheels`) into the site folder with our plugin's entry point (gpu_wheels.install),
  refused first by the folder's size check, which reads the tree's size recorded at `--prepare` time (nothing on the
  device calls git). Skipped when the site says it holds that folder already (a warm machine's second call).
- `imports`: the Engine's import chain in a fresh interpreter, as the stages' Engines will import it (CUDA: sglang,
  sgl_kernel, flashinfer, xgrammar; CPU: sglang beside the import shims), the versions it found and our plugin's entry
  point among SGLang's plugins. A failure here fails the stage: every Engine stage after it would fail the same way.
- `gpu`: nvidia-smi's name, memory and driver (CUDA only).

On CPU the rehearsal runs `install` only when it is given a folder (CI gives one of stand-in wheels: gpu_wheels
standin), so the device's install path runs on every commit; the stand-ins are metadata only and stay off the path
(gpu_session.sh puts the site on PYTHONPATH on CUDA only), since a package that finds its own files through its
metadata (xgrammar's bindings, through tvm_ffi) would look in the stand-in. The CPU import chain is the environment's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dflash_sglang.bench.gpu import wheels as gpu_wheels
from dflash_sglang.bench.gpu.context import Context, Table, run_logged

INSTALLED = ".installed"  # in the site folder: which wheel folder it holds
IMPORTS = {  # per device: the modules the stages' Engines import, then the Engine itself
    "cuda": ("sglang", "sgl_kernel", "flashinfer", "xgrammar"),
    "cpu": ("sglang",),
}
VERSIONS = ("sglang", "flashinfer-python", "transformers", "torch")
PLUGIN = "dflash_sglang"


def import_check_source(modules: tuple[str, ...]) -> str:
    """The child's program: import `modules` and the Engine, print the versions, exit 3 if our plugin's entry point is
    not among SGLang's plugins (SGLang would serve its builtin DFLASH instead of ours)."""
    return "\n".join([
        "import importlib.metadata as md, sys",
        *[f"import {m}" for m in modules],
        "from sglang.srt.entrypoints.engine import Engine",
        "def v(n):",
        "    try:",
        "        return md.version(n)",
        "    except md.PackageNotFoundError:",
        "        return '-'",
        f"print(' '.join(f'{{n}} {{v(n)}}' for n in {VERSIONS!r}))",
        "plugins = [e.name for e in md.entry_points(group='sglang.srt.plugins')]",
        "print('plugins', plugins)",
        f"sys.exit(0 if {PLUGIN!r} in plugins else 3)",
    ])


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int | str, str]:
    """(exit status or "timeout", the output's last line) of `cmd`, its output in `log`."""
    rc = run_logged(cmd, log, timeout, env=env)
    if rc == "timeout":
        return rc, f"killed after {timeout:.0f} s"
    lines = log.read_text(errors="replace").strip().splitlines()
    return rc, lines[-1][:200] if lines else ""


def install_row(ctx: Context, timeout: float) -> dict:
    folder, site = ctx.wheels, ctx.site
    if folder is None:
        return {"verdict": "skipped: no wheel folder given (the CPU rehearsal's own environment serves)"}
    marker = site / INSTALLED
    if marker.is_file() and marker.read_text().strip() == str(folder.resolve()):
        return {"note": f"{site} holds {folder} already (a warm machine)", "verdict": "pass"}
    if (why := gpu_wheels.check(folder)) is not None:
        return {"note": why, "verdict": "FAIL: the wheel folder was refused"}
    rc, last = _run([sys.executable, "-c", "import sys; from dflash_sglang.bench.gpu.wheels import install; "
                     "from pathlib import Path; print(install(Path(sys.argv[1]), Path(sys.argv[2])), 'wheels')",
                     str(folder), str(site)], ctx.work / "install.log", timeout)
    if rc != 0:
        return {"note": last, "verdict": f"FAIL: the install exited {rc} (install.log)"}
    if (missing := site_lacks(site)):
        return {"note": f"{site} lacks {', '.join(missing)}", "verdict": "FAIL: the install left the site incomplete"}
    marker.write_text(str(folder.resolve()))
    return {"note": f"{last} into {site}, our plugin's entry point beside them", "verdict": "pass"}


def site_lacks(site: Path) -> list[str]:
    """The pins (and our plugin's entry point) that the site's installed metadata does not hold."""
    import importlib.metadata as md

    dists = {gpu_wheels._norm(d.metadata["Name"]): d for d in md.distributions(path=[str(site)])}
    missing = [f"{p.name}=={p.version}" for p in gpu_wheels.PINNED
               if dists.get(gpu_wheels._norm(p.name)) is None or dists[gpu_wheels._norm(p.name)].version != p.version]
    ours = dists.get(gpu_wheels._norm("dflash-sglang"))
    if ours is None or not any(e.name == PLUGIN for e in ours.entry_points.select(group="sglang.srt.plugins")):
        missing.append("our plugin's entry point")
    return missing


def imports_row(ctx: Context, timeout: float) -> dict:
    from dflash_sglang.measure.cpu_env import cpu_env

    env = {**os.environ, **(cpu_env(gpu_wheels.REPO) if not ctx.cuda else {})}
    rc, last = _run([sys.executable, "-c", import_check_source(IMPORTS[ctx.device])], ctx.work / "imports.log",
                    timeout, env)
    log = ctx.work / "imports.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    versions = next((line for line in text.splitlines() if line.startswith("sglang ")), "")
    if rc == 3:
        return {"note": versions, "verdict": f"FAIL: our plugin's entry point is not among SGLang's plugins ({last})"}
    if rc != 0:
        return {"note": last, "verdict": f"FAIL: the import chain exited {rc} (imports.log)"}
    return {"note": versions, "verdict": "pass"}


def gpu_row(ctx: Context) -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"note": str(e), "verdict": "FAIL: nvidia-smi did not answer"}
    return {"note": out.stdout.strip().replace("\n", "; "),
            "verdict": "pass" if out.returncode == 0 else f"FAIL: nvidia-smi exited {out.returncode}"}


def stage_prelude(ctx: Context) -> Table:
    """Stage 0: the time before the session, the install, the import chain, the GPU."""
    table = Table(f"Stage 0: install and import ({ctx.device})", ["what", "seconds", "note", "verdict"])
    table.add(what="started", seconds=round(ctx.started_s, 1), note="interpreter and torch before the session's clock",
              verdict="pass")
    for what, est, row in (("install", 60.0, install_row), ("imports", 60.0, imports_row)):
        t0 = time.monotonic()
        table.add(what=what, **row(ctx, ctx.timeout(est)), seconds=round(time.monotonic() - t0, 1))
        ctx.publish(table)
    if ctx.cuda:
        table.add(what="gpu", **gpu_row(ctx))
    return table
