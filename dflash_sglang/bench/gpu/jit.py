"""What a GPU session's stage JIT-compiled, measured from the build caches (FlashInfer, torch extensions and our CUDA
ops build on first use on every fresh machine; nobody knew how long that takes, so each stage reports it).

Ninja-built modules (FlashInfer's, torch extensions') leave a `.ninja_log` beside their build: one line per compile job
with its start and end in milliseconds. A stage's JIT seconds are the durations of the jobs whose outputs were written
during the stage (their sum: compile-job seconds, which run in parallel, so an upper bound of the wall time they
cost). Shared objects and Triton kernels that appeared during the stage are counted too (Triton and our nvcc build
record no durations).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def cache_roots() -> list[Path]:
    """Where the JIT builds land: FlashInfer's, torch extensions' and our kernels' folders under ~/.cache, Triton's
    cache and the folders their environment variables name (not all of ~/.cache: pip's own cache is large)."""
    home = Path.home()
    roots = [home / ".cache" / d for d in ("flashinfer", "torch_extensions", "dflash_sglang")]
    roots.append(home / ".triton" / "cache")
    for var in ("TORCH_EXTENSIONS_DIR", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "DFLASH_SGLANG_HOME"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]))
    return [r for r in dict.fromkeys(roots) if r.is_dir()]


@dataclass(frozen=True)
class JitUse:
    """What was compiled between two moments: ninja compile jobs and their seconds, new shared objects, new Triton
    kernels."""

    jobs: int
    job_s: float
    shared_objects: int
    triton_kernels: int

    def describe(self) -> str:
        if not (self.jobs or self.shared_objects or self.triton_kernels):
            return "nothing compiled"
        return (f"{self.jobs} compile jobs ({self.job_s:.0f} s of compile-job time), {self.shared_objects} new shared "
                f"objects, {self.triton_kernels} new Triton kernels")


def _ninja_jobs(log: Path, since: float) -> list[float]:
    """Seconds of each job in a .ninja_log whose output was written at or after `since` (epoch seconds)."""
    jobs = []
    for line in log.read_text(errors="replace").splitlines():
        parts = line.split("\t")
        if line.startswith("#") or len(parts) < 4:
            continue
        try:
            start_ms, end_ms, output = int(parts[0]), int(parts[1]), parts[3]
        except ValueError:
            continue
        out = Path(output) if os.path.isabs(output) else log.parent / output
        try:
            if out.stat().st_mtime >= since:
                jobs.append(max(end_ms - start_ms, 0) / 1e3)
        except OSError:
            continue
    return jobs


def jit_since(since: float, roots: list[Path] | None = None) -> JitUse:
    """What the caches under `roots` gained since `since` (epoch seconds)."""
    jobs: list[float] = []
    shared = triton = 0
    for root in cache_roots() if roots is None else roots:
        for path in root.rglob("*"):
            try:
                if not path.is_file() or path.stat().st_mtime < since:
                    continue
            except OSError:
                continue
            if path.name == ".ninja_log":
                jobs += _ninja_jobs(path, since)
            elif path.suffix == ".so":
                shared += 1
            elif path.suffix == ".cubin" and "triton" in str(path):
                triton += 1
    return JitUse(len(jobs), round(sum(jobs), 1), shared, triton)
