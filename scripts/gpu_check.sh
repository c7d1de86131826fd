#!/usr/bin/env bash
# The GPU checks of the project, one stage per argument, each ending with a short table. Needs a CUDA torch
# (DFLASH_KEEP_TORCH=1 bash scripts/setup.sh) and, for `sglang`, sglang with its CUDA deps (0.5.17 beside torch 2.11,
# 0.5.23 beside torch 2.14.1).
#
#   ops     CUDA kernels == core/ references (eager + CUDA-graph replay); scripts/bench_ops.py table
#   train   convert the SmolLM2 testbed target, regenerate responses + train a drafter (GPU time budgets)
#   accept  tau of $DRAFT_DIR on 200 held-out eval prompts x 128 new tokens (reference decoder): block 8/16
#           chains and 16/32/64-node trees, T=0 and T=1
#   sglang  FlashInfer draft attention == torch reference (tests/test_draft_attention.py; over an fp8 draft pool:
#           tests/test_draft_kv.py), then SGLang Engine e2e
#           on CUDA (tests/test_sglang_gpu.py: chain, tree, adaptive vs no speculation)
#   pareto  scripts/bench_pareto.py on the testbed pair, concurrency 1/8/32: ours / builtin / no speculation
#           (chain), then ours with a 32-node tree (eager verify; tree_graph: verify CUDA graphs with the mask,
#           --speculative-dflash-tree-cuda-graph) and adaptive (--speculative-adaptive); chain_eager: ours with the
#           draft pass and commit eager (--speculative-dflash-draft-graphs eager), to measure the draft graphs
#           (PARETO_MODES picks among chain chain_eager tree tree_graph adaptive)
#
# Results land in $RESULTS (default gpu_results/); record the tables in docs/benchmarks.md with the date.
# Knobs (env): TRAIN_SAMPLES (6144), SAVE_EVERY (500: resumable checkpoints; a rerun with the same DRAFT_DIR resumes), TRAIN_NEW_TOKENS (192), TRAIN_BATCH (32), TRAIN_ANCHORS (48: blocks per sequence), DATA_MIN (3), TRAIN_MIN (4; the
# schedule is fitted to this budget from the first steps' time), TRAIN_STEPS (a fixed step count instead of
# TRAIN_MIN), TRAIN_INIT (target; or a draft checkpoint dir to fine-tune, e.g. the shipped drafter: annealed from a low lr, on
# the train-split prompts after the first TRAIN_SKIP (6144, the shipped drafter's)), CACHE_DIR (feature cache, default $DRAFT_DIR.cache), DRAFT_DIR (train: where the drafter goes, default $RESULTS/smollm2_135m_dflash; accept/sglang: the drafter
# measured, default the shipped one), EVAL_PROMPTS (200), EVAL_NEW_TOKENS (128).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu_results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
status=0
testbed_target() { $PY -c 'from dflash_sglang.testbed.target import target_dir; print(target_dir())'; }

stage_ops() {
  $PY -m pytest -q -ra tests/test_ops_gpu.py 2>&1 | tee "$RESULTS/ops_tests.log" || status=1
  $PY scripts/bench_ops.py --dispatch 2>&1 | tee "$RESULTS/bench_ops.log" || status=1
}

stage_train() {
  local out=${DRAFT_DIR:-$RESULTS/smollm2_135m_dflash}
  $PY - <<'EOF' || { status=1; return; }
from dflash_sglang.testbed.target import convert_target
print("target:", convert_target())
EOF
  # The `dflash-sglang train` defaults (docs/benchmarks.md, issue 38): CE + logit distillation, gamma 1.25; from
  # --init target a warm-up to 1e-3 (the shipped drafter's recipe), from a draft checkpoint (TRAIN_INIT=DIR) a
  # cosine from the low fine-tune lr with no warm-up, on the prompts after the 6144 the shipped drafter saw.
  local schedule=(--time-budget-min "${TRAIN_MIN:-4}")
  [ -n "${TRAIN_STEPS:-}" ] && schedule=(--max-steps "$TRAIN_STEPS")
  local init=${TRAIN_INIT:-target} recipe=(--lr 1e-3)
  [ "$init" != target ] && [ "$init" != random ] && recipe=(--skip-samples "${TRAIN_SKIP:-6144}")
  $PY -m dflash_sglang train --data sharegpt --out "$out" --cache-dir "${CACHE_DIR:-$out.cache}" \
      --num-samples "${TRAIN_SAMPLES:-6144}" --max-new-tokens "${TRAIN_NEW_TOKENS:-192}" --gen-batch-size 512 \
      --data-time-budget-min "${DATA_MIN:-3}" --block-size 16 --num-layers 2 --num-features 5 \
      --batch-size "${TRAIN_BATCH:-32}" --num-anchors "${TRAIN_ANCHORS:-48}" "${recipe[@]}" --epochs 40 "${schedule[@]}" --init "$init" \
      --save-every "${SAVE_EVERY:-500}" 2>&1 | grep -v "it/s\]" | tee "$RESULTS/train.log" || { status=1; return; }
  $PY -m dflash_sglang inspect "$out" || status=1
}

stage_accept() {
  local draft=${DRAFT_DIR:-dflash_sglang/assets/smollm2_135m_dflash} n=${EVAL_PROMPTS:-200}
  local common=(--target "$(testbed_target)" --draft "$draft" --num-prompts "$n" --max-new-tokens "${EVAL_NEW_TOKENS:-128}" --batch-size "$n"
                --temperature 0,1)
  $PY scripts/bench_accept.py "${common[@]}" --block-sizes 8,16 --out "$RESULTS/accept_chain" 2>&1 \
      | tee "$RESULTS/accept_chain.log" || status=1
  $PY scripts/bench_accept.py "${common[@]}" --block-sizes 16 --tree-nodes 0,16,32,64 --tree-topk 4 \
      --out "$RESULTS/accept_tree" 2>&1 | tee "$RESULTS/accept_tree.log" || status=1
}

stage_sglang() {
  $PY -m pytest -q -ra tests/test_draft_attention.py tests/test_draft_kv.py tests/test_draft_graphs.py tests/test_sglang_gpu.py 2>&1 | tee "$RESULTS/sglang_gpu_tests.log" || status=1
}

stage_pareto() {
  # bf16 for every arm: the converted target's config says float32, which SGLang serves as float16, and the
  # builtin DFLASH (0.5.17) then fails on the bf16 drafter (Half vs BFloat16 in project_target_hidden)
  local draft=${DRAFT_DIR:-dflash_sglang/assets/smollm2_135m_dflash}
  local attn="--dtype bfloat16 --attention-backend flashinfer --cuda-graph-max-bs-decode 32"
  local common=(--target "$(testbed_target)" --draft "$draft" --dataset sharegpt --output-len 128 --num-prompts 64
                --concurrency 1,8,32 --max-running-requests 32 --hardware auto)
  # Every arm gets the same attention backend; tree verification needs flashinfer or triton.
  for mode in ${PARETO_MODES:-chain tree adaptive}; do
    case $mode in
      chain) $PY scripts/bench_pareto.py "${common[@]}" --arms ours,builtin,none --server-args="$attn" \
               --out "$RESULTS/pareto_chain" 2>&1 | tee "$RESULTS/pareto_chain.log" || status=1 ;;
      chain_eager) $PY scripts/bench_pareto.py "${common[@]}" --arms ours \
               --server-args="$attn --speculative-dflash-draft-graphs eager" --out "$RESULTS/pareto_chain_eager" \
               2>&1 | tee "$RESULTS/pareto_chain_eager.log" || status=1 ;;
      tree|tree_graph) $PY scripts/bench_pareto.py "${common[@]}" --arms ours \
              --server-args="$attn --speculative-eagle-topk 4 --speculative-num-draft-tokens 32$([ "$mode" = tree_graph ] \
                              && echo " --speculative-dflash-tree-cuda-graph")" \
              --out "$RESULTS/pareto_$mode" 2>&1 | tee "$RESULTS/pareto_$mode.log" || status=1 ;;
      adaptive) $PY scripts/bench_pareto.py "${common[@]}" --arms ours --server-args="$attn --speculative-adaptive" \
                  --out "$RESULTS/pareto_adaptive" 2>&1 | tee "$RESULTS/pareto_adaptive.log" || status=1 ;;
    esac
  done
}

for stage in "${@:-ops}"; do
  echo "=== stage $stage ($(date -u +%FT%TZ))"
  "stage_$stage"
done
exit $status
