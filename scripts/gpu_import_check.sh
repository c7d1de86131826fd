#!/usr/bin/env bash
# The GPU session's import chain, proven here before a device window (issue 56 item 5): a virtualenv holding only
# packages of the device image (its package list: docs/gpu_session.md), at its versions where this machine can have them, the
# carried wheels installed as the device installs them (gpu_wheels install), then: the device's import check
# (gpu_prelude), the same chain as a CUDA process takes it (sm90 simulated), the carried cp312 binaries on Python 3.12,
# and a CPU Engine with our DFLASH worker on a tiny pair generating tokens.
#
#   bash scripts/gpu_import_check.sh [--work DIR] [--wheels DIR] [--fresh]
#
# --work DIR (default /tmp/devimport): virtualenvs, site, tiny pair, logs. --wheels DIR (default .whl; prepared with
# gpu_wheels prepare when it holds no wheel). --fresh: rebuild the virtualenvs. About 4.5 min fresh on 2 cores.
# What cannot match: no CPU torch 2.11 for cp312 exists on the registries here (PyPI's linux torch is a CUDA build:
# refused), so unless a cp312 +cpu wheel appears it runs Python 3.11 with the local torch CPU build and cp311 builds of
# the carried wheels that are cp312-only (same pins, repacked as gpu_wheels does); torchvision (a CUDA build here) and,
# for the CPU Engine only, vllm._custom_ops are import shims. Ends with "package | device | here | matched?" and
# `gpu_import_check: PASS` or `gpu_import_check: FAIL: <what>` (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORK=/tmp/devimport WHEELS=.whl FRESH=0 LOCAL_TORCH=/opt/wheels  # (pip's find-links here: the CPU torch builds)
while [ $# -gt 0 ]; do
  case "$1" in
    --work) WORK="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --fresh) FRESH=1; shift ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) echo "gpu_import_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
mkdir -p "$WORK/logs"
VENV=$WORK/venv SITE=$WORK/site V=$WORK/venv/bin/python
fail() { echo "gpu_import_check: FAIL: $*"; exit 1; }

# (1) The interpreter: 3.12 (the device's) only with a CPU torch for it; pip must never resolve PyPI's plain torch.
PYVER="" TORCH=""
for ver in 3.12 3.11; do
  py=$(ls -d /root/.pyenv/versions/$ver.*/bin/python3 2>/dev/null | tail -1 || true)
  [ -n "$py" ] || py=$(command -v "python$ver" || true)
  whl=$(ls "$LOCAL_TORCH"/torch-*+cpu-cp${ver/./}-*.whl 2>/dev/null | sort -V | tail -1 || true)
  if [ -z "$whl" ] && [ -n "$py" ] && [ "$ver" = 3.12 ]; then  # a registry's +cpu build (the label says CPU)
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$WORK/torch" torch==2.11.0+cpu \
      >"$WORK/logs/torch_probe.log" 2>&1 && whl=$(ls "$WORK"/torch/torch-2.11.0+cpu-*.whl | tail -1) || true
  fi
  [ -n "$py" ] && [ -n "$whl" ] && { PYBASE=$py PYVER=$ver TORCH=$whl; break; }
done
[ -n "$PYVER" ] || fail "no Python 3.12/3.11 with a CPU torch wheel"
echo "gpu_import_check: Python $PYVER ($PYBASE), torch $(basename "$TORCH")"

# (2) The image's packages the chain imports, --no-deps: nothing enters that the image lacks. Pinned to the image's
# version (KINDS.md pip list) or below it where this Python has no build of it (numpy 2.5 is cp312+).
IMAGE=("transformers==5.17.0" "huggingface-hub==1.33.0" "tokenizers==0.23.2" "safetensors==0.8.0" "numpy<=2.5.2"
  "sentencepiece==0.2.2" "tiktoken==0.14.0" "triton==3.6.0" filelock typing-extensions sympy mpmath networkx jinja2
  markupsafe fsspec setuptools packaging pyyaml regex tqdm typer click rich shellingham markdown-it-py mdurl pygments
  httpx anyio h11 httpcore certifi idna hf-xet aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache
  yarl requests charset-normalizer urllib3 psutil uvloop pillow einops prometheus-client msgpack cloudpickle pytest
  pluggy iniconfig nvidia-ml-py ninja tabulate "cuda-bindings<14" cuda-pathfinder)
if [ "$FRESH" = 1 ] || [ ! -f "$VENV/.image" ]; then
  rm -rf "$VENV" "$SITE" "$WORK/venv312" && "$PYBASE" -m venv "$VENV"
  $V -m pip install -q --no-deps "$TORCH" "${IMAGE[@]}" >"$WORK/logs/image.log" 2>&1 || fail "image packages (logs/image.log)"
  touch "$VENV/.image"
fi

# (3) The carried wheels, installed as gpu_session.sh does (gpu_wheels install: --no-index --no-deps --target).
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  command -v strip >/dev/null || fail "no $WHEELS and no strip to prepare it"
  python3 -m dflash_sglang.bench.gpu.wheels prepare --dir "$WHEELS" >"$WORK/logs/prepare.log" 2>&1 \
    || fail "gpu_wheels prepare (logs/prepare.log)"
fi
FOLDER=$WHEELS
if [ "$PYVER" != 3.12 ]; then  # the same pins; a cp312-only wheel swapped for this Python's build, repacked alike
  FOLDER=$WORK/whl-cp${PYVER/./}
  $V - "$WHEELS" "$FOLDER" >"$WORK/logs/swap.log" 2>&1 <<'EOF' || fail "cp${PYVER/./} wheels (logs/swap.log)"
import shutil, subprocess, sys
from pathlib import Path
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename
from dflash_sglang.bench.gpu.wheels import repack
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.whl"))  # prepared.json: the tree's size, for the check
tags = set(sys_tags())
for w in sorted(src.glob("*.whl")):
    name, version, _, wtags = parse_wheel_filename(w.name)
    if wtags & tags:
        shutil.copy(w, dst)
        continue
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dst),
                    f"{name}=={version}"], check=True)
    new = next(p for p in dst.glob("*.whl") if parse_wheel_filename(p.name)[:2] == (name, version))
    repack(new)
    print("swapped", w.name, "->", new.name)
EOF
fi
if [ ! -f "$SITE/.installed" ] || [ "$(cat "$SITE/.installed")" != "$FOLDER" ]; then
  rm -rf "$SITE"
  $V -m dflash_sglang.bench.gpu.wheels install --dir "$FOLDER" --target "$SITE" >"$WORK/logs/install.log" 2>&1 \
    || fail "gpu_wheels install (logs/install.log)"
  echo "$FOLDER" >"$SITE/.installed"
fi

# (3b) The carried cp312 binaries themselves (the ones swapped above), on the device's Python without torch: each
# loads, and xgrammar's stripped bindings build a grammar (its __init__ imports torch, so the bindings alone).
CP312=skipped
if [ "$PYVER" != 3.12 ] && PY312=$(ls -d /root/.pyenv/versions/3.12.*/bin/python3 2>/dev/null | tail -1); then
  [ -x "$WORK/venv312/bin/python" ] || { "$PY312" -m venv "$WORK/venv312" \
    && "$WORK/venv312/bin/python" -m pip install -q --no-deps typing-extensions >/dev/null 2>&1; }
  rm -rf "$WORK/site312" && CP312=fail
  "$WORK/venv312/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site312" \
    "$WHEELS"/*.whl >"$WORK/logs/cp312.log" 2>&1 && PYTHONPATH="$WORK/site312" "$WORK/venv312/bin/python" -c '
import importlib, importlib.util, sys, types
for m in ("pydantic_core", "zmq", "msgspec", "orjson", "pybase64", "setproctitle", "jiter", "tvm_ffi"):
    importlib.import_module(m)
path = list(importlib.util.find_spec("xgrammar").submodule_search_locations)
sys.modules["xgrammar"] = types.ModuleType("xgrammar")
sys.modules["xgrammar"].__path__ = path
import xgrammar.load_binding
from xgrammar.grammar import Grammar
assert "root ::=" in str(Grammar.builtin_json_grammar())' >>"$WORK/logs/cp312.log" 2>&1 && CP312=load
fi

# Import shims (tests/sglang_shims): torchvision, which the image has (0.26.0) but here exists only as a CUDA build
# that fails to import beside a CPU torch; and for the CPU Engine only, vllm._custom_ops, which SGLang's CPU path
# imports and its CUDA path does not (the image lacks vllm). The real triton 3.6.0 is kept: no triton shim.
shims() { rm -rf "$WORK/$1" && mkdir -p "$WORK/$1" && for s in _shim_stub.py "${@:2}"; do
  ln -s "$PWD/tests/sglang_shims/$s" "$WORK/$1/$s"; done; echo "$WORK/$1"; }
IMAGE_SHIMS=$(shims shims-image torchvision) CPU_SHIMS=$(shims shims-cpu vllm torchvision)

# (4) The device's import check (gpu_prelude, stage 0: sglang, sgl_kernel, flashinfer, xgrammar, the Engine, our
# plugin's entry point), with gpu_session.sh's PYTHONPATH (checkout + site) and the torchvision shim only. Less
# sgl_kernel: its __init__ loads sm90/common_ops (CUDA 13, torch 2.11's ABI) on a compute-capability-9.0 GPU and
# sm100/ (trimmed) elsewhere, so no CPU imports it; instead, its sm90 library must be there and link CUDA 13.
export PYTHONPATH="$PWD:$SITE"
IMPORTS=$($V -c 'from dflash_sglang.bench.gpu.prelude import IMPORTS, import_check_source as s
print(s(tuple(m for m in IMPORTS["cuda"] if m != "sgl_kernel")))')
IMPORT_OK=1
PYTHONPATH="$IMAGE_SHIMS:$PYTHONPATH" $V -c "$IMPORTS" >"$WORK/logs/import.log" 2>&1 || IMPORT_OK=0
SM90=$(ls "$SITE"/sgl_kernel/sm90/common_ops.*.so 2>/dev/null | head -1 || true)
KERNEL_CUDA=$([ -n "$SM90" ] && readelf -d "$SM90" | grep -o 'libcudart.so.[0-9]*' || echo missing)

# (4b) The same chain as a CUDA process would take it: torch told it is a CUDA 13 build on one sm90 GPU (nothing
# runs), sgl_kernel's op library load stubbed, then the modules a CUDA Engine of the GPU stages imports (scheduler,
# model runner, FlashInfer/Triton/GDN attention, the stages' models, our adapter). Catches a package that only SGLang's
# or FlashInfer's CUDA branches import (FlashInfer's comm needs cuda-bindings, which the image has).
cat >"$WORK/cuda_sim.py" <<'EOF'
import importlib, importlib.util, pkgutil, sys, types
import torch

class Props:
    major, minor, name, total_memory, multi_processor_count = 9, 0, "NVIDIA H200", 140 << 30, 132

for attr, value in {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                    "get_device_capability": lambda *a, **k: (9, 0), "get_device_name": lambda *a, **k: Props.name,
                    "get_device_properties": lambda *a, **k: Props()}.items():
    setattr(torch.cuda, attr, value)
torch.version.cuda = "13.0"
spec = importlib.util.find_spec("sgl_kernel")  # its load_utils first, so that __init__ gets the stubbed loader
lu_spec = importlib.util.spec_from_file_location("sgl_kernel.load_utils", spec.submodule_search_locations[0] +
                                                 "/load_utils.py")
lu = sys.modules["sgl_kernel.load_utils"] = importlib.util.module_from_spec(lu_spec)
lu_spec.loader.exec_module(lu)
lu._load_architecture_specific_ops = lambda: types.ModuleType("common_ops")
import dflash_sglang.adapter as adapter
mods = sys.argv[1:] + [m.name for m in pkgutil.walk_packages(adapter.__path__, "dflash_sglang.adapter.")]
failed = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        failed.append(f"cuda_sim: FAIL {m}: {type(e).__name__}: {e}")
print("\n".join(failed) or f"cuda_sim: {len(mods)} modules imported")
sys.exit(1 if failed else 0)
EOF
CUDA_OK=1
PYTHONPATH="$IMAGE_SHIMS:$PYTHONPATH" $V "$WORK/cuda_sim.py" sgl_kernel sglang flashinfer xgrammar \
  sglang.srt.entrypoints.engine sglang.srt.managers.scheduler sglang.srt.model_executor.model_runner \
  sglang.srt.model_executor.runner.decode_cuda_graph_runner sglang.srt.layers.attention.flashinfer_backend \
  sglang.srt.layers.attention.triton_backend sglang.srt.layers.attention.hybrid_linear_attn_backend \
  sglang.srt.layers.attention.linear.gdn_backend sglang.srt.models.llama sglang.srt.models.qwen3 \
  sglang.srt.models.qwen3_5 sglang.srt.constrained.xgrammar_backend flashinfer.decode flashinfer.prefill \
  flashinfer.sampling flashinfer.jit >"$WORK/logs/cuda_sim.log" 2>&1 || CUDA_OK=0

# (5) A CPU Engine with our worker on the tiny pair (gpu_targets.tiny_pair), greedy, our start-up line in its log.
ENGINE_OK=0
cat >"$WORK/engine_check.py" <<'EOF'
import sys
from pathlib import Path

if __name__ == "__main__":  # (a file with a main guard: SGLang spawns its scheduler, which re-imports __main__)
    import sglang as sgl
    from dflash_sglang.bench.gpu.targets import tiny_pair

    root = tiny_pair(Path(sys.argv[1]) / "pair", hidden=32)
    engine = sgl.Engine(model_path=str(root / "target"), device="cpu", attention_backend="torch_native",
                        dtype="float32", skip_tokenizer_init=True, speculative_algorithm="DFLASH",
                        speculative_draft_model_path=str(root / "draft"), max_total_tokens=2048,
                        chunked_prefill_size=16, log_level="info", random_seed=0)
    try:
        out = engine.generate(input_ids=[[1, 3, 2, 5]], sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                                         "ignore_eos": True})
        print("engine output_ids", out[0]["output_ids"], out[0]["meta_info"].get("spec_verify_ct"))
        assert len(out[0]["output_ids"]) == 8, out
    finally:
        engine.shutdown()
EOF
PYTHONPATH="$CPU_SHIMS:$PYTHONPATH" SGLANG_PLUGINS=dflash_sglang OMP_NUM_THREADS=1 timeout 600 \
  $V "$WORK/engine_check.py" "$WORK" >"$WORK/logs/engine.log" 2>&1 && ENGINE_OK=1 || true
MARKER=$($V -c 'from dflash_sglang.bench.serving.pareto import OURS_LOG_MARKER as m; print(m)')
grep -qF "$MARKER" "$WORK/logs/engine.log" || ENGINE_OK=0

# (6) The table: the device's versions (KINDS.md, gpu_wheels.PINNED) against this virtualenv's.
$V - "$PYVER" <<'EOF'
import importlib.metadata as md, sys
dev = {"python": "3.12.3", "torch": "2.11.0+cu130", "transformers": "5.17.0", "triton": "3.6.0", "numpy": "2.5.2",
       "tokenizers": "0.23.2", "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "torchvision": "0.26.0",
       "sglang": "0.5.17", "sglang-kernel": "0.4.5", "flashinfer-python": "0.6.15.post1", "xgrammar": "0.2.1"}
print("| package | device | here | matched? |\n|---|---|---|---|")
for name, want in dev.items():
    try:
        have = sys.version.split()[0] if name == "python" else md.version(name)
    except md.PackageNotFoundError:
        have = "shim" if name == "torchvision" else "-"
    print(f"| {name} | {want} | {have} | {'yes' if have == want else 'no'} |")
EOF
echo "| sgl_kernel sm90 library | libcudart.so.13 (cu130) | $KERNEL_CUDA | $([ "$KERNEL_CUDA" = libcudart.so.13 ] \
  && echo yes || echo no) |"
echo "| CUDA-path imports (sm90 simulated, logs/cuda_sim.log) | import | $([ "$CUDA_OK" = 1 ] && echo "import | yes" \
  || echo "fail | no") |"
echo "| carried cp312 binaries on Python 3.12 (no torch) | load | $CP312 | $([ $CP312 = load ] && echo yes || echo no) |"
echo "(carried wheels from $FOLDER; logs in $WORK/logs; $(( $(date +%s) - start )) s)"
[ "$IMPORT_OK" = 1 ] || fail "gpu_session.sh's import line: $(grep -v '^ ' "$WORK/logs/import.log" | tail -1)"
[ "$CUDA_OK" = 1 ] || fail "the chain as CUDA takes it: $(grep -m1 'cuda_sim: FAIL' "$WORK/logs/cuda_sim.log")"
[ "$KERNEL_CUDA" = libcudart.so.13 ] || fail "sgl_kernel's sm90 library: $KERNEL_CUDA"
[ "$CP312" != fail ] || fail "the carried cp312 binaries on Python 3.12: $(tail -1 "$WORK/logs/cp312.log")"
[ "$ENGINE_OK" = 1 ] || fail "CPU Engine with DFLASH: $(grep -E 'Error|error' "$WORK/logs/engine.log" | tail -1)"
echo "gpu_import_check: PASS"
