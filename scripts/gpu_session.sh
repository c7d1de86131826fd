#!/usr/bin/env bash
# The GPU session in one prepared call (docs/gpu_session.md): every stage within one budget counted from this line,
# stage 0 installing what the lent machine lacks from the carried wheel folder; each stage's table in $OUT as soon as
# it ends. Nothing here calls git or downloads anything, except --prepare (run here, before the call).
#
#   bash scripts/gpu_session.sh --prepare            # once, on a machine with the registry: pip download of the
#                                                    # pinned wheels into .whl/, trimmed; records the tree's size
#                                                    # beside them; prints sizes, refuses > 60 MiB
#   bash scripts/gpu_session.sh [--budget-s 510]     # on the GPU machine: install (unless done), import, stages
#   bash scripts/gpu_session.sh --install            # stage 0 only (a first call, when two are needed)
#   bash scripts/gpu_session.sh --device cpu         # the rehearsal (CI): the same driver at tiny sizes on the CPU
#   bash scripts/gpu_session.sh --list               # the plan: each stage's estimates against the budget
#
# Options: --wheels DIR (default .whl on CUDA; on CPU only when given: CI gives stand-in wheels), --site DIR (install
# target, default /tmp/dflash_site), --out DIR (default $OUT, else work_tmp/gpu_session), --work DIR, --stages
# 0,1,2,3,4,5, --budget-s SECONDS (the whole call: default 510 on CUDA; 420 on CPU, a cap: the rehearsal takes less).
STARTED=$(date +%s.%N)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
MODE=run DEVICE=cuda WHEELS="" SITE=/tmp/dflash_site BUDGET="" ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare; shift ;;
    --install) MODE=install; shift ;;
    --list) ARGS+=(--list); shift ;;
    --device) DEVICE="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --site) SITE="$2"; shift 2 ;;
    --budget-s) BUDGET="$2"; shift 2 ;;
    --out|--stages|--work) ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "gpu_session: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

case "$DEVICE" in
  cuda) WHEELS=${WHEELS:-.whl} ;;
  cpu) [ "$MODE" = install ] && [ -z "$WHEELS" ] && { echo "gpu_session: --install on CPU needs --wheels" >&2; exit 2; } ;;
  *) echo "gpu_session: --device cuda|cpu, got $DEVICE" >&2; exit 2 ;;
esac
if [ "$MODE" = prepare ]; then
  exec $PY -m dflash_sglang.bench.gpu.wheels prepare --dir "${WHEELS:-.whl}"
fi
[ "$MODE" = install ] && ARGS+=(--stages 0)
# The site goes on the path now: stage 0 fills it, and every Engine and test the stages start imports from it (on CPU
# the environment serves: the rehearsal's stand-in wheels are metadata only, gpu_prelude.py)
[ "$DEVICE" = cuda ] && export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
exec $PY -m dflash_sglang.bench.gpu.session --device "$DEVICE" --started-at "$STARTED" --site "$SITE" \
  ${WHEELS:+--wheels "$WHEELS"} --budget-s "${BUDGET:-$([ "$DEVICE" = cuda ] && echo 510 || echo 420)}" \
  ${ARGS[@]+"${ARGS[@]}"}
