"""The last call's window on the device. The budget is counted from the call's start and split between regenerating
the target's responses and training on them. The phases (receive, join, convert, regenerate, train, pack) run in
order, the heavy ones as subprocesses with timeouts cut from the budget; each is timed and given a verdict computed
from its figures. The report (train.md, train.json, logs.tar.gz) is rewritten after every phase.

Why a verdict per phase and a rewrite after each one: only $OUT comes back, and the call is killed at its timeout. A
window that runs out of time or breaks still returns what it did and names the phase that failed; a window that made
the drafter worse fails its train phase rather than shipping it.
"""
from __future__ import annotations

import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dflash_sglang.bench.gpu.context import Budget, Table
from dflash_sglang.bench.gpu.device import pack_logs, write_whole
from dflash_sglang.bench.gpu.train.carry import (MIB, PROMPTS, check_part, join_target, pack_drafter, read_manifest,
                                                 receive)
from dflash_sglang.bench.gpu.train.plan import REPO, SHIPPED, Places, Size

SLACK_S = 30.0  # past the budget, for the trainer's export (the call's timeout is the budget + 60 s)


def split_budget(left_s: float, size: Size, share: float) -> tuple[float, float]:
    """(regeneration seconds, training seconds) of the `left_s` seconds left once the target is converted: the
    processes' start-up and the packing are set aside (size.est), then `share` of the rest regenerates. ValueError
    when either would fall under its floor."""
    if not 0 < share < 1:
        raise ValueError(f"--data-share must lie in (0, 1), got {share}")
    rest = left_s - size.est["regenerate"] - size.est["train"] - size.est["pack"]
    data, train = share * rest, (1 - share) * rest
    if data < size.min_data_s or train < size.min_train_s:
        raise ValueError(f"{left_s:.0f} s left leave {max(data, 0):.0f} s to regenerate and {max(train, 0):.0f} s to "
                         f"train, under the {size.min_data_s:.0f} s / {size.min_train_s:.0f} s floors: a longer "
                         f"--budget-s or another --data-share")
    return data, train


def regenerate_verdict(rc: int | str, sequences: int, floor: int) -> str:
    if rc != 0:
        return f"FAIL: regeneration exited {rc} (regenerate.log)"
    if sequences < floor:
        return f"FAIL: {sequences} sequences regenerated, under the window's floor of {floor}"
    return "pass"


def train_verdict(rc: int | str, summary: bool, losses: list[float], val: list[dict], min_steps: int) -> str:
    """pass when the run exported its drafter after at least `min_steps` finite-loss steps, and, over 20 steps or
    more, its last 10 steps' mean loss is under its first 10's and its held-out tau_est (where it has held-out
    sequences) did not fall from where it started: a window that made the drafter worse is not one to ship from."""
    if rc != 0 or not summary:
        return f"FAIL: train exited {rc}{'' if summary else ' without its summary'} (train.log)"
    if len(losses) < min_steps:
        return f"FAIL: {len(losses)} optimizer steps, under the window's floor of {min_steps}"
    if not all(math.isfinite(x) for x in losses):
        return f"FAIL: the loss went non-finite ({losses[-1]})"
    if len(losses) >= 20:
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        if last >= first:
            return f"FAIL: the loss did not fall (first 10 steps {first:.3g}, last 10 {last:.3g})"
        if len(val) >= 2 and val[-1]["tau_est"] < val[0]["tau_est"]:
            return f"FAIL: the held-out tau_est fell ({val[0]['tau_est']:.3f} -> {val[-1]['tau_est']:.3f})"
    return "pass"


def verdict(table: Table) -> str:
    """The window's verdict in a few words: FAILED (naming the phases) before not run in full before passed."""
    if bad := [r["phase"] for r in table.rows if str(r.get("verdict", "")).startswith("FAIL")]:
        return f"FAILED ({', '.join(bad)})"
    if skipped := [r["phase"] for r in table.rows if str(r.get("verdict", "")).startswith("skipped")]:
        return f"not run in full (skipped: {', '.join(skipped)})"
    return "passed" if table.rows else "nothing ran"


@dataclass
class Window:
    """The last call's phases, each timed and recorded in a row of `table`; train.md / train.json rewritten after
    every phase, so a call killed at its timeout still returns what was done."""

    device: str
    places: Places
    budget: Budget
    size: Size
    init: str
    share: float
    started_s: float = 0.0
    env: dict | None = None  # the subprocesses' environment (the rehearsal's git trap)

    def __post_init__(self):
        self.table = Table(f"Training window on {self.device}", ["phase", "seconds", "planned", "figures", "verdict"])
        self.results = Table("Drafter", ["prompts", "sequences", "tokens", "steps", "steps/s", "loss", "held-out loss",
                                         "held-out tau_est", "verdict"])
        self.record: dict = {"device": self.device, "budget_s": self.budget.total_s, "init": self.init,
                             "data_share": self.share}
        for p in (self.places.work, self.places.out):
            p.mkdir(parents=True, exist_ok=True)

    # --------------------------------------------------------------------------- bookkeeping
    def write(self) -> None:
        notes = (f"- budget {self.budget.total_s:.0f} s from the call's start, {max(self.budget.left(), 0):.0f} s "
                 f"left; the interpreter took {self.started_s:.1f} s before the clock")
        text = (f"# Training window ({self.device})\n\n**verdict: {verdict(self.table)}**\n\n"
                f"{self.table.markdown()}\n\n{self.results.markdown()}\n\n{notes}\n")
        write_whole(self.places.out / "train.md", text)
        write_whole(self.places.out / "train.json", json.dumps(
            {**self.record, "verdict": verdict(self.table), "phases": self.table.rows,
             "results": self.results.rows}, indent=1))
        pack_logs(self.places.work, self.places.out / "logs.tar.gz", recursive=False)

    def phase(self, name: str, planned: float | None, fn) -> bool:
        """Run `fn() -> (figures, verdict)` as phase `name`; False when it did not pass."""
        t0 = time.monotonic()
        try:
            figures, verdict = fn()
        except Exception as e:  # a broken phase is a row, not a lost report
            figures, verdict = "", f"FAIL: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.table.add(phase=name, seconds=round(time.monotonic() - t0, 1), planned=planned, figures=figures,
                       verdict=verdict)
        print(f"=== {name}: {verdict} ({figures}) in {time.monotonic() - t0:.0f} s, {self.budget.left():.0f} s left",
              flush=True)
        self.write()
        return verdict == "pass"

    def skip_rest(self, names: list[str], why: str) -> None:
        for name in names:
            self.table.add(phase=name, verdict=f"skipped: {why}")
        self.write()

    def _run(self, name: str, cmd: list[str], timeout: float, extra_path: list[Path] = ()) -> int | str:
        path = os.pathsep.join(str(p) for p in (*extra_path, REPO, os.environ.get("PYTHONPATH")) if p)
        env = {**(self.env or os.environ), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        with open(self.places.work / f"{name}.log", "w") as log:
            try:
                return subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=max(timeout, 10.0)).returncode
            except subprocess.TimeoutExpired:
                return "timeout"

    # --------------------------------------------------------------------------- phases
    def run(self, folders: list[Path]) -> int:
        w, size, est = self.places.work, self.size, self.size.est
        self.table.add(phase="started", seconds=round(self.started_s, 1), figures="interpreter before the clock",
                       verdict="pass")
        manifest = read_manifest(folders[-1]) if folders else None
        self.record["manifest"], self.folders = manifest, folders
        later = ["join", "convert", "regenerate", "train", "pack"]
        if not self.phase("receive", None, lambda: self.receive(folders, manifest)):
            return self.finish(later, "nothing to train on")
        if not self.phase("join", est["join"], lambda: self.join(manifest)):
            return self.finish(later[1:], "no target")
        reserve = size.min_data_s + size.min_train_s + est["regenerate"] + est["train"] + est["pack"]
        if not self.phase("convert", est["convert"], lambda: self.convert(self.budget.timeout(est["convert"],
                                                                                              reserve))):
            return self.finish(later[2:], "no target")
        try:
            data_s, train_s = split_budget(self.budget.left(), size, self.share)
        except ValueError as e:
            return self.finish(later[2:], str(e))
        self.record["split_s"] = {"regenerate": round(data_s), "train": round(train_s)}
        if not self.phase("regenerate", data_s + est["regenerate"], lambda: self.regenerate(manifest, data_s)):
            return self.finish(later[3:], "no training data")
        train_s = self.budget.left() - est["train"] - est["pack"]
        if train_s < size.min_train_s:
            return self.finish(later[3:], f"budget ({self.budget.left():.0f} s left)")
        self.phase("train", train_s + est["train"], lambda: self.train(manifest, train_s))
        if (w / "drafter" / "model.safetensors").is_file():
            self.phase("pack", est["pack"], self.pack)
        else:
            self.skip_rest(["pack"], "no exported drafter")
        return self.finish([], "")

    def finish(self, skipped: list[str], why: str) -> int:
        if skipped:
            self.skip_rest(skipped, why)
        self.write()
        return int(self.table.status() == "failed")

    def receive(self, folders: list[Path], manifest: dict | None) -> tuple[str, str]:
        if manifest is None:
            return f"no call folder under {self.places.carry}", "FAIL: nothing carried (run prepare, carry call-N)"
        got = receive(folders, self.places.store)
        return f"{', '.join(got) or 'no part carried now'}; {manifest['calls']} calls in all", "pass"

    def join(self, manifest: dict) -> tuple[str, str]:
        site = self.places.work / "site"
        path = join_target(manifest, self.places.store, site)
        wheel = manifest.get("wheel")
        if wheel is not None and not (site / "gguf").is_dir():
            src = next(f / wheel["name"] for f in self.folders if (f / wheel["name"]).is_file())
            check_part(src, {**wheel, "bytes": src.stat().st_size})
            with zipfile.ZipFile(src) as z:  # pure Python: unpacked, no pip
                z.extractall(site)
        prompts = self.places.work / "prompts.json"
        src = next(f / PROMPTS for f in self.folders if (f / PROMPTS).is_file())
        check_part(src, {"name": PROMPTS, "bytes": src.stat().st_size, "sha256": manifest["prompts"]["sha256"]})
        prompts.write_bytes(lzma.decompress(src.read_bytes()))
        stream = manifest["stream"]
        return (f"{path.name} {path.stat().st_size / MIB:.1f} MiB, sha256 ok, from {len(manifest['parts'])} parts of "
                f"{stream['codec']} ({stream['bytes'] / MIB:.1f} MiB); gguf "
                f"{'from the carried wheel' if wheel else 'of the environment'}"), "pass"

    def convert(self, timeout: float) -> tuple[str, str]:
        target = self.places.work / "target"
        code = ("import sys; from pathlib import Path; from dflash_sglang.testbed.target import convert_target; "
                "print(convert_target(Path(sys.argv[1])))")
        rc = self._run("convert", [sys.executable, "-c", code, str(target)], timeout, [self.places.work / "site"])
        marker = target / "dflash_convert.json"
        if rc != 0 or not marker.is_file():
            return "", f"FAIL: the conversion exited {rc} (convert.log)"
        m = json.loads(marker.read_text())
        return (f"fp32 safetensors, max abs logit difference {m.get('max_abs_logit_diff', '-')} against the "
                f"{m.get('verified_against', '-')}"), "pass"

    def cli(self, manifest: dict) -> list[str]:
        size, w = self.size, self.places.work
        n = manifest["prompts"]["count"] - size.val
        recipe = ["--lr", "1e-3"] if self.init == "target" else []  # the shipped drafter's recipe from the target
        return [sys.executable, "-m", "dflash_sglang", "train", "--target", str(w / "target"), "--data",
                str(w / "prompts.json"), "--out", str(w / "drafter"), "--cache-dir", str(w / "cache"),
                "--num-samples", str(n), "--val-samples", str(size.val), "--max-new-tokens", str(size.new_tokens),
                "--gen-batch-size", str(size.gen_batch), "--block-size", "16", "--num-layers", str(size.layers),
                "--num-features", str(size.features), "--batch-size", str(size.batch), "--num-anchors",
                str(size.anchors), "--epochs", "40", "--init", self.init, "--save-every", "500", "--device",
                self.device, *recipe, *(["--no-bf16"] if self.device == "cpu" else [])]

    def regenerate(self, manifest: dict, data_s: float) -> tuple[str, str]:
        cmd = self.cli(manifest) + ["--prepare-only", "--data-time-budget-min", f"{data_s / 60:.3f}"]
        t0 = time.monotonic()
        # past its data budget the CLI finishes the shard it is on; the timeout keeps the training floor
        rc = self._run("regenerate", cmd, self.budget.timeout(data_s + self.size.est["regenerate"],
                                                              self.size.min_train_s + self.size.est["train"]))
        sequences, tokens = cache_counts(self.places.work / "cache")
        took = time.monotonic() - t0
        self.results.rows[:] = [{"prompts": manifest["prompts"]["count"] - self.size.val, "sequences": sequences,
                                 "tokens": tokens, "verdict": "-"}]
        if rc == "timeout" and sequences:
            rc = 0  # killed mid-shard: the complete shards are kept and trained on
        return (f"{sequences} sequences ({tokens} tokens) of {manifest['prompts']['count'] - self.size.val} prompts "
                f"in {took:.0f} s ({sequences / max(took, 1e-9):.1f}/s); {self.size.val} held out"), \
            regenerate_verdict(rc, sequences, self.size.min_sequences)

    def train(self, manifest: dict, train_s: float) -> tuple[str, str]:
        schedule = (["--max-steps", str(self.size.steps)] if self.size.steps
                    else ["--time-budget-min", f"{train_s / 60:.3f}"])
        # a fresh run every window: a warm machine's earlier checkpoints would be resumed, on their own schedule
        shutil.rmtree(self.places.work / "drafter", ignore_errors=True)
        # the trainer stops itself at its budget and exports; killing it would lose the drafter, so its timeout
        # reaches SLACK_S past the window's budget (into what the call's timeout leaves beyond it)
        rc = self._run("train", self.cli(manifest) + ["--skip-prepare", *schedule],
                       self.budget.left() + SLACK_S - self.size.est["pack"])
        d = self.places.work / "drafter"
        summary = json.loads((d / "train_summary.json").read_text()) if (d / "train_summary.json").is_file() else {}
        logged = [json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines() if line.strip()] \
            if (d / "train_log.jsonl").is_file() else []
        steps = [r for r in logged if "loss" in r]
        val = [r["val"] for r in logged if "val" in r and "loss" not in r]
        losses = [float(r["loss"]) for r in steps]
        rate = ((steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"])
                if len(steps) > 2 and steps[-1]["elapsed_s"] > steps[0]["elapsed_s"] else None)
        head, tail = losses[:10], losses[-10:]
        verdict = train_verdict(rc, bool(summary), losses, val, self.size.min_steps)
        row = self.results.rows[0] if self.results.rows else {}
        row.update({"steps": len(losses), "steps/s": rate, "verdict": verdict,
                    "loss": f"{sum(head) / len(head):.3g} -> {sum(tail) / len(tail):.3g}" if losses else None,
                    "held-out loss": f"{val[0]['loss']:.4g} -> {val[-1]['loss']:.4g}" if val else None,
                    "held-out tau_est": f"{val[0]['tau_est']:.3f} -> {val[-1]['tau_est']:.3f}" if val else None})
        self.results.rows[:] = [row]
        self.record["train_summary"] = summary
        return (f"{len(losses)} steps from --init {'shipped' if self.init == str(SHIPPED) else self.init}"
                f"{f' at {rate:.1f} steps/s' if rate else ''}"), verdict

    def pack(self) -> tuple[str, str]:
        record = pack_drafter(self.places.work / "drafter", self.places.out, self.size.part, self.places.work)
        self.record["drafter"] = record
        sizes = " + ".join(f"{p['bytes'] / MIB:.2f}" for p in record["parts"])
        return f"{len(record['parts'])} parts ({sizes} MiB), sha256 in train.json", "pass"


def cache_counts(cache: Path) -> tuple[int, int]:
    """(sequences, tokens) in a feature cache's shards (its val/ folder left out), from the headers alone."""
    from safetensors import safe_open

    from dflash_sglang.train.shards import list_shards

    sequences = tokens = 0
    for shard in list_shards(cache) if cache.is_dir() else []:
        with safe_open(str(shard), framework="pt") as f:
            sequences += f.get_slice("offsets").get_shape()[0] - 1
            tokens += f.get_slice("tokens").get_shape()[0]
    return sequences, tokens
