#!/usr/bin/env bash
# The GPU session in one prepared call (docs/gpu_session.md): install what the lent machine lacks from the carried
# wheel folder, then every stage within a budget, each stage's table in $OUT as soon as it ends.
#
#   bash scripts/gpu_session.sh --prepare            # once, on a machine with the registry: pip download of the
#                                                    # pinned wheels into .whl/, trimmed; prints sizes, refuses > 60 MiB
#   bash scripts/gpu_session.sh [--budget-s 480]     # on the GPU machine: size check, install (unless done), stages
#   bash scripts/gpu_session.sh --install            # install only (a first call, when two are needed)
#   bash scripts/gpu_session.sh --device cpu         # the rehearsal (CI): the same driver at tiny sizes on the CPU
#
# Options: --wheels DIR (default .whl), --site DIR (install target, default /tmp/dflash_site), --out DIR (default
# $OUT, else work_tmp/gpu_session), --stages 1,2,3,4,5, --budget-s SECONDS (default 480 on CUDA; 420 on CPU, a cap:
# the rehearsal takes less).
# Nothing here downloads anything except --prepare; the size check runs before any GPU time is spent on the install.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
MODE=run DEVICE=cuda WHEELS=.whl SITE=/tmp/dflash_site BUDGET="" ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare; shift ;;
    --install) MODE=install; shift ;;
    --device) DEVICE="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --site) SITE="$2"; shift 2 ;;
    --budget-s) BUDGET="$2"; shift 2 ;;
    --out|--stages|--work) ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "gpu_session: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [ "$MODE" = prepare ]; then
  exec $PY -m dflash_sglang.bench.gpu_wheels prepare --dir "$WHEELS"
fi

if [ "$DEVICE" = cuda ]; then
  # Refused here, before the install spends device time: a folder that cannot travel, or one missing a wheel.
  if [ ! -f "$SITE/.installed" ]; then
    $PY -m dflash_sglang.bench.gpu_wheels install --dir "$WHEELS" --target "$SITE" || exit 2
    echo "$WHEELS" > "$SITE/.installed"
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  # The whole Engine import chain, once, so a missing package is named before any stage starts an Engine.
  $PY -c 'import sglang, sgl_kernel, flashinfer, xgrammar
from sglang.srt.entrypoints.engine import Engine
import importlib.metadata as md
print("gpu_session: sglang", md.version("sglang"), "flashinfer", md.version("flashinfer-python"), "transformers",
      md.version("transformers"), "torch", md.version("torch"), "plugins",
      [e.name for e in md.entry_points(group="sglang.srt.plugins")])' || echo "gpu_session: the SGLang import chain" \
      "failed (above): the Engine stages will fail; stage 1 still runs" >&2
  [ "$MODE" = install ] && exit 0
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu_session: /'
elif [ "$DEVICE" = cpu ]; then
  [ "$MODE" = install ] && { echo "gpu_session: --install is for the GPU machine" >&2; exit 2; }
else
  echo "gpu_session: --device cuda|cpu, got $DEVICE" >&2; exit 2
fi

exec $PY -m dflash_sglang.bench.gpu_session --device "$DEVICE" --budget-s "${BUDGET:-$([ "$DEVICE" = cuda ] \
  && echo 480 || echo 420)}" ${ARGS[@]+"${ARGS[@]}"}
