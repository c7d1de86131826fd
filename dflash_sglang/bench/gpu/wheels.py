"""The wheels a lent GPU machine lacks, in one carried folder: pinned, downloaded once, trimmed, checked, installed.

The lent machines (H100 / H200, docs/gpu_session.md) hold Python 3.12, torch 2.11 cu130, triton, transformers 5.17,
nvcc and about 200 packages (/work/.library/device/KINDS.md), no registry. SGLang 0.5.17 is the newest release whose
pins that torch satisfies; what its Engine import chain (CPU and CUDA paths) needs beyond the image is `PINNED`: the
release, its CUDA kernels (sglang-kernel), FlashInfer (our draft attention and the target's), xgrammar and the
pure-Python packages of the chain. How the list was found: the Engine's import closure over the extracted wheels
(module-level imports, other platforms' branches pruned), checked by starting CPU Engines in an interpreter that sees
only the image's packages plus these wheels (docs/gpu_session.md, "The carried wheels").

Everything travels in one call with the working tree, so the folder must stay under `FOLDER_LIMIT` and the folder plus
the tree under the device's `CALL_LIMIT`. Four wheels carry what no check here runs (`TRIMS`): sglang-kernel's FA3 /
FlashMLA / InfLLM / sm100 libraries (the lent GPUs are sm90; FlashInfer serves attention), xgrammar's static library
and debug symbols, SGLang's optional native servers (Rust HTTP, gRPC, multimodal) and its diffusion runtime,
FlashInfer's bundled CUTLASS examples and tests. A trimmed
wheel gets a new RECORD, so pip installs it as any other; every wheel is recompressed with LZMA (`repack`). One
source patch (`PATCHES`): SGLang's config registrations told `exist_ok`, so 0.5.17 imports beside the image's
transformers 5.17 instead of carrying its own 5.12.1.

  python -m dflash_sglang.bench.gpu.wheels prepare [--dir .whl]      # once, on a machine with the registry
  python -m dflash_sglang.bench.gpu.wheels check [--dir .whl]        # here: the size refusal, the tree re-measured
  python -m dflash_sglang.bench.gpu.wheels install --dir .whl --target /tmp/dflash_site   # on the device, offline
  python -m dflash_sglang.bench.gpu.wheels standin --dir DIR         # CI: metadata-only wheels, one per pin

Only `prepare`, `check` and `standin` ask git (the tree's size, recorded in the folder's `prepared.json`); what runs
on the device reads the record.
"""
from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MIB = 1 << 20
FOLDER_LIMIT = 60 * MIB  # issue 47: the carried folder
CALL_LIMIT = 64 * MIB  # the device tool: working tree + carried paths, per call
PYTHON = "3.12"  # the device image's python3
RECORD = "prepared.json"  # beside the wheels: the working tree's size, measured with git when the folder was made
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    why: str


PINNED = (
    Pin("sglang", "0.5.17", "the release the device's torch 2.11 allows"),
    Pin("sglang-kernel", "0.4.5", "SGLang's CUDA kernels (norms, activations, sampling, the builtin DFLASH)"),
    Pin("flashinfer-python", "0.6.15.post1", "target and draft attention on CUDA (JIT-built with the image's nvcc)"),
    Pin("apache-tvm-ffi", "0.1.11", "FlashInfer's JIT modules and xgrammar's bindings"),
    Pin("xgrammar", "0.2.1", "the grammar backend the scheduler builds"),
    Pin("compressed-tensors", "0.20.0", "imported by SGLang's quantization registry"),
    Pin("loguru", "0.7.3", "compressed-tensors"),
    Pin("pydantic", "2.13.4", "SGLang's request and server-args models"),
    Pin("pydantic-core", "2.46.4", "pydantic"),
    Pin("annotated-types", "0.7.0", "pydantic"),
    Pin("typing-inspection", "0.4.2", "pydantic"),
    Pin("fastapi", "0.115.14", "imported by the Engine's entrypoints (newer ones import opentelemetry)"),
    Pin("starlette", "0.46.2", "fastapi; sglang.srt.utils"),
    Pin("uvicorn", "0.54.0", "imported by the Engine's entrypoints"),
    Pin("pyzmq", "27.3.0", "the Engine's inter-process messages"),
    Pin("msgspec", "0.22.0", "the Engine's inter-process structs"),
    Pin("orjson", "3.11.4", "SGLang's JSON"),
    Pin("pybase64", "1.5.1", "sglang.srt.utils"),
    Pin("setproctitle", "1.3.8", "the scheduler and detokenizer processes"),
    Pin("dill", "0.4.1", "custom logit processors (imported by the sampling params)"),
    Pin("partial-json-parser", "0.2.1.1.post7", "function-call parsers (imported by the tokenizer manager)"),
    Pin("openai", "2.6.1", "the OpenAI protocol models (imported by io_struct)"),
    Pin("distro", "1.9.0", "openai"),
    Pin("jiter", "0.11.1", "openai"),
    Pin("sniffio", "1.3.1", "openai"),
    Pin("gguf", "0.17.1", "SGLang's GGUF quantization module (imported by the loader)"),
    Pin("ipython", "8.18.1", "sglang.utils (imported by sglang.lang, which the package imports)"),
    Pin("decorator", "5.2.1", "ipython"),
    Pin("matplotlib-inline", "0.1.7", "ipython"),
    Pin("prompt-toolkit", "3.0.52", "ipython"),
    Pin("wcwidth", "0.2.13", "prompt-toolkit"),
    Pin("stack-data", "0.6.3", "ipython"),
    Pin("executing", "2.2.1", "stack-data"),
    Pin("asttokens", "3.0.1", "stack-data"),
    Pin("pure-eval", "0.2.3", "stack-data"),
    Pin("traitlets", "5.14.3", "ipython"),
    Pin("pexpect", "4.9.0", "ipython"),
    Pin("ptyprocess", "0.7.0", "pexpect"),
)
TRIMS: dict[str, tuple[str, ...]] = {  # wheel name prefix -> glob patterns of members left out
    "sglang_kernel-": ("sgl_kernel/flash_ops*", "sgl_kernel/flashmla_ops*", "sgl_kernel/infllm_ops*",
                       "sgl_kernel/sm100/*"),
    "xgrammar-": ("xgrammar/lib/*.a",),
    "sglang-": ("sglang/srt/server/_core*", "sglang/srt/grpc/_core*", "sglang/srt/multimodal/_core*",
                "sglang/multimodal_gen/*", "sglang/test/*"),
    "flashinfer_python-": ("flashinfer/data/cutlass/examples/*", "flashinfer/data/cutlass/test/*",
                           "flashinfer/data/cccl/*/test/*", "flashinfer/data/cccl/benchmarks/*"),
}
STRIP = ("xgrammar/*.so",)  # shipped with debug info: `strip --strip-unneeded` keeps the code
# SGLang 0.5.17 registers config classes for model types that transformers 5.17 (the image's) has since added itself
# (qwen3_asr, ...), which transformers refuses at import unless told `exist_ok`; carrying 0.5.17's own transformers
# (5.12.1, 10 MiB) does not fit beside the tree. The registrations are for models these checks never load.
REGISTER = re.compile(r"\b(AutoConfig|CONFIG_MAPPING)\.register\(([^()\n]*?)\)")


def exist_ok_registrations(source: str) -> str:
    """`AutoConfig.register(name, cls)` -> `AutoConfig.register(name, cls, exist_ok=True)` (calls that say it kept)."""
    return REGISTER.sub(lambda m: m[0] if "exist_ok" in m[2] else f"{m[1]}.register({m[2]}, exist_ok=True)", source)


PATCHES = {"sglang-": ("sglang/*.py", exist_ok_registrations)}  # wheel name prefix -> (members, source rewrite)


def repack(path: Path) -> tuple[int, int]:
    """Rewrite the wheel at `path` without the members TRIMS names for it, STRIP's shared objects stripped, PATCHES
    applied, every
    member LZMA-compressed (Python's zipfile reads it, so pip does; 11% smaller than deflate here) and a RECORD that
    matches the members (pip checks nothing else). Returns (bytes before, bytes after)."""
    drop = next((pats for prefix, pats in TRIMS.items() if path.name.startswith(prefix)), ())
    patch = next((rule for prefix, rule in PATCHES.items() if path.name.startswith(prefix)), None)
    before = path.stat().st_size
    tmp = path.with_suffix(".repack")
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as out:
        infos = z.infolist()
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        rows = []
        for info in infos:
            if info.filename == record or _matches(info.filename, drop) or info.is_dir():
                continue
            data = z.read(info)
            if _matches(info.filename, STRIP):
                data = _stripped(data)
            if patch is not None and fnmatch.fnmatch(info.filename, patch[0]):
                data = patch[1](data.decode()).encode()
            rows.append(record_row(info.filename, data))
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr, member.compress_type = info.external_attr, zipfile.ZIP_LZMA
            out.writestr(member, data)
        out.writestr(record, record_text(rows, record))
    tmp.replace(path)
    return before, path.stat().st_size


def record_row(name: str, data: bytes) -> tuple[str, str, str]:
    """A wheel member's RECORD row: its name, sha256 (urlsafe base64, unpadded) and size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return name, f"sha256={digest}", str(len(data))


def record_text(rows: list[tuple[str, str, str]], record: str) -> str:
    """The RECORD file of these rows, itself last with no hash (csv: names with commas quoted)."""
    lines = io.StringIO()
    csv.writer(lines, lineterminator="\n").writerows(rows + [(record, "", "")])
    return lines.getvalue()


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _stripped(data: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        so = Path(d) / "lib.so"
        so.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", str(so)], check=True)
        return so.read_bytes()


def download_command(pin: Pin, dest: Path, python: str = PYTHON) -> list[str]:
    """pip download of one pinned wheel for the device's interpreter (binary only, no dependencies: all are pinned)."""
    platforms = [a for p in PLATFORMS if p != "any" for a in ("--platform", p)] + ["--platform", "any"]
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            python, "--implementation", "cp", *platforms, "-d", str(dest), f"{pin.name}=={pin.version}"]


def prepare(dest: Path, python: str = PYTHON) -> list[tuple[str, int, int]]:
    """Download every pin into `dest` (emptied of other wheels first: one version of each), trim them; (wheel,
    bytes downloaded, bytes kept) per wheel."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    for pin in PINNED:
        subprocess.run(download_command(pin, dest, python), check=True)
    return [(w.name, *repack(w)) for w in sorted(dest.glob("*.whl"))]


def tree_bytes(repo: Path = REPO) -> int:
    """What the device tool carries of the checkout besides the folder: tracked files and untracked ones git does not
    ignore, as they are on disk now. Asks git, so it runs here only (`prepare`, `check`, `standin`): the device gets a
    copy of the working tree with no promise of a `.git`, and reads the size this recorded (`recorded_tree`)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return sum((repo / p).stat().st_size for p in out.decode().split("\0") if p and (repo / p).is_file())


def record_tree(folder: Path, repo: Path = REPO) -> int:
    """Measure the working tree (git) and record it in the folder (`RECORD`), which travels with the wheels."""
    tree = tree_bytes(repo)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECORD).write_text(json.dumps({"tree_bytes": tree, "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z")}))
    return tree


def recorded_tree(folder: Path) -> int | None:
    """The tree's size `record_tree` wrote beside the wheels, or None (no record, or one this code cannot read)."""
    try:
        return int(json.loads((folder / RECORD).read_text())["tree_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def size_refusal(folder_bytes: int, tree: int) -> str | None:
    """Why a folder of `folder_bytes` cannot travel beside a tree of `tree` bytes, or None."""
    if folder_bytes > FOLDER_LIMIT:
        return (f"the wheel folder holds {folder_bytes / MIB:.1f} MiB, over the {FOLDER_LIMIT // MIB} MiB a GPU "
                f"session may carry: prepare it again (bash scripts/gpu_session.sh --prepare) and check the trims")
    if folder_bytes + tree > CALL_LIMIT:
        return (f"the wheel folder ({folder_bytes / MIB:.1f} MiB) and the working tree ({tree / MIB:.1f} MiB) make "
                f"{(folder_bytes + tree) / MIB:.1f} MiB, over the {CALL_LIMIT // MIB} MiB one device call carries: "
                f"move untracked files out of the tree or trim the folder")
    return None


def check(folder: Path, tree: int | None = None) -> str | None:
    """The refusal for `folder` (None: it may travel) beside a tree of `tree` bytes (None: the size recorded in the
    folder at `prepare` time; nothing here calls git). A missing or empty folder says how to prepare it."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return (f"no wheels in {folder}: on a machine with the registry run, once, "
                f"bash scripts/gpu_session.sh --prepare (pip download of the pinned wheels, trimmed)")
    missing = [p.name for p in PINNED if not any(_wheel_name(w) == _norm(p.name) for w in wheels)]
    if missing:
        return f"{folder} lacks {', '.join(missing)}: bash scripts/gpu_session.sh --prepare"
    tree = recorded_tree(folder) if tree is None else tree
    if tree is None:
        return (f"{folder}/{RECORD} does not say how large the working tree is: run `bash scripts/gpu_session.sh "
                f"--prepare` (or `python -m dflash_sglang.bench.gpu.wheels check`) in the checkout, where git is")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return size_refusal(size, tree)


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _wheel_name(wheel: Path) -> str:
    return _norm(wheel.name.split("-")[0])


def install_command(folder: Path, target: Path) -> list[str]:
    """pip install of the folder's wheels into `target`, offline, no dependency resolution (all are pinned)."""
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(target), *map(str, sorted(folder.glob("*.whl")))]


def register_plugin(target: Path, repo: Path = REPO) -> Path:
    """Our SGLang plugin's entry point, as an editable install registers it, in `target` (beside the wheels): the
    checkout itself goes on PYTHONPATH, so nothing is built or copied. Returns the dist-info folder."""
    import tomllib

    meta = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    info = target / f"dflash_sglang-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dflash-sglang\nVersion: {meta['version']}\n")
    groups = meta["entry-points"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n" for group, points in groups.items()))
    return info


def table(rows: list[tuple[str, int, int]]) -> str:
    lines = ["| wheel | downloaded MiB | carried MiB |", "|---|---|---|"]
    lines += [f"| {name} | {a / MIB:.1f} | {b / MIB:.1f} |" for name, a, b in rows]
    total = sum(b for _, _, b in rows)
    return "\n".join(lines + [f"| total ({len(rows)} wheels) | {sum(a for _, a, _ in rows) / MIB:.1f} | "
                              f"{total / MIB:.1f} |"])


def standin(folder: Path) -> list[Path]:
    """One stand-in wheel per pin in `folder` (emptied of wheels first): its name and version, metadata only, no
    module. CI installs them as the device installs the real ones, so the install path (size check from the record,
    pip into the target, the plugin's entry point) runs on every commit without downloading anything; the packages
    themselves come from the CPU environment. Records the tree's size as `prepare` does."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    wheels = []
    for pin in PINNED:
        name, info = _norm(pin.name), f"{_norm(pin.name)}-{pin.version}.dist-info"
        members = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pin.name}\nVersion: {pin.version}\n"
                                       f"Summary: stand-in (gpu_wheels standin): {pin.why}\n",
                   f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: dflash_sglang\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n"}
        wheel = folder / f"{name}-{pin.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            for member, text in members.items():
                z.writestr(member, text)
            z.writestr(f"{info}/RECORD", record_text([record_row(m, t.encode()) for m, t in members.items()],
                                                     f"{info}/RECORD"))
        wheels.append(wheel)
    record_tree(folder)
    return wheels


def install(folder: Path, target: Path) -> int:
    """pip install of the folder's wheels into `target` and our plugin's entry point beside them; the number of
    wheels. Offline; asks no git (the device runs it)."""
    subprocess.run(install_command(folder, target), check=True)
    register_plugin(target)
    return len(list(folder.glob("*.whl")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("prepare", "check", "install", "list", "standin"))
    p.add_argument("--dir", type=Path, default=REPO / ".whl")
    p.add_argument("--target", type=Path, default=Path("/tmp/dflash_site"))
    p.add_argument("--python-version", default=PYTHON, help="prepare: the interpreter the wheels are for")
    args = p.parse_args(argv)
    if args.action == "list":
        print("\n".join(f"{pin.name}=={pin.version}  # {pin.why}" for pin in PINNED))
        return 0
    if args.action == "prepare":
        if shutil.which("strip") is None:
            raise SystemExit("gpu_wheels prepare: needs `strip` (binutils) for xgrammar's debug symbols")
        print(table(prepare(args.dir, args.python_version)))
    if args.action == "standin":
        print(f"gpu_wheels: {len(standin(args.dir))} stand-in wheels in {args.dir}")
    if args.action in ("prepare", "check"):  # here, where git is: the tree as it is now, recorded for the device
        record_tree(args.dir)
    if (why := check(args.dir)) is not None:
        print(f"gpu_wheels: REFUSED: {why}", file=sys.stderr)
        return 2
    size, tree = sum(f.stat().st_size for f in args.dir.glob("*.whl")), recorded_tree(args.dir)
    print(f"gpu_wheels: {args.dir} {size / MIB:.1f} MiB + working tree {tree / MIB:.1f} MiB (recorded) = "
          f"{(size + tree) / MIB:.1f} MiB of {CALL_LIMIT // MIB} MiB per call: one call carries both")
    if args.action == "install":
        print(f"gpu_wheels: installed {install(args.dir, args.target)} wheels and our plugin's entry point into "
              f"{args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
