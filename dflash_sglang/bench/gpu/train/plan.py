"""What a window is sized at on each device and where its files lie (`Size`, `SIZES`, `Places`), and `prepare`, run
here before the device calls: it cuts the GGUF's xz stream into one folder per call, puts the train-split prompts and
the gguf wheel in the last folder and a manifest in each, and prints the calls to make.

Why this happens here and not on the device: nothing on the device path calls git or a registry. So the prompts are
chosen, the wheel fetched and every folder checked against the limits (with the working tree at its size now) before
anything is carried. A folder that would not fit is refused before a device minute is spent.
"""
from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_sglang.bench.gpu.train.carry import (CALL_LIMIT, MANIFEST, MARGIN, MIB, PROMPTS, call_refusal, cut,
                                                 part_sizes, sha256_file, xz_stream)

REPO = Path(__file__).resolve().parents[4]  # dflash_sglang/bench/gpu/train/plan.py -> the checkout
GGUF_WHEEL = "gguf-0.17.1-py3-none-any.whl"  # bench/gpu/wheels.py pins it; the image has no gguf
SHIPPED = REPO / "dflash_sglang" / "assets" / "smollm2_135m_dflash"
SHIPPED_PROMPTS = 6144  # the shipped drafter's training prompts (its TRAINING.md): the count to beat


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


def write_prompts(gguf: Path, cache: Path, skip: int, size: Size) -> tuple[Path, list[dict]]:
    """The prompts file the last call carries (xz of `train_prompts_json`, the GGUF's own tokenizer) and its records;
    ValueError when none would be left to train on beside the held-out ones."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    records = train_prompts_json(tok, skip, size.prompts)
    if len(records) <= size.val:
        raise ValueError(f"{len(records)} train-split prompts after the first {skip}: none left to train on")
    prompts = cache / PROMPTS
    prompts.write_bytes(lzma.compress(json.dumps(records, ensure_ascii=False).encode(), preset=6))
    return prompts, records


def prepare(device: str, places: Places, gguf: Path, tree: int, skip: int = 0) -> dict:
    """Make places.carry/call-1 .. call-N: the GGUF's xz stream in parts that fill each call alike (`part_sizes`),
    the prompts file and the gguf wheel in the last, the manifest in each; refuse (ValueError) what a call could not
    carry beside a working tree of `tree` bytes. Returns the manifest."""
    size = SIZES[device]
    room = size.room or CALL_LIMIT - tree - MARGIN
    cache = places.carry / "cache"
    stream = xz_stream(gguf, cache)
    prompts, records = write_prompts(gguf, cache, skip, size)
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


def run_calls(manifest: dict, places: Places, budget_s: float) -> list[str]:
    """The device tool's calls, in order: every one but the last receives, the last trains."""
    rel = places.carry.relative_to(REPO)
    calls = [f'run(command="bash scripts/gpu_train.sh --receive", carry=["{rel}/call-{k}"], timeout_s=120)'
             for k in range(1, manifest["calls"])]
    return calls + [f'run(command="bash scripts/gpu_train.sh --budget-s {budget_s:.0f}", '
                    f'carry=["{rel}/call-{manifest["calls"]}"], timeout_s={min(600, int(budget_s) + 60)})']
