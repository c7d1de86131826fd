#!/usr/bin/env bash
# One command that checks the plugin on one SGLang release of the supported range (0.5.17 .. 0.5.23):
#
#   bash scripts/check_sglang.sh VERSION
#
# 1. installs it (.ci/install_sglang.sh: its pins, this environment's CPU torch kept) into the layered virtualenv
#    .venv-sglang-VERSION, unless it is the release this environment has itself;
# 2. the version seam's probes against what that release has (tests/test_sglang_versions.py), the plugin suite (every
#    flag, resolution and refusal: tests/test_sglang_plugin.py) and the tree / simulate / adaptive pieces;
# 3. CPU Engines end to end against a plain Engine, one Engine at a time (a shared machine): chain, tree and the
#    goodput controller on the full e2e scenario (greedy and sampled, stops, penalties and min_new_tokens, logprobs,
#    hidden states, grammar, context limit, aborts: tests/test_sglang_e2e.py, the subset -k selects; the TP, DP,
#    router, PD, DFlash2, ShareGPT and Qwen3 Engines are left to .ci/run).
# Ends with one line: release, passed / failed / skipped counts, seconds, exit status. About 8 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
VERSION=${1:?usage: bash scripts/check_sglang.sh VERSION (0.5.17 .. 0.5.23)}
ENGINES=chain,tree,goodput,plain

start=$(date +%s)
own=$(python -c 'from importlib.metadata import version; print(version("sglang"))' 2>/dev/null || true)
if [ "$VERSION" = "$own" ]; then
  PY=python
else
  bash .ci/install_sglang.sh "$VERSION" --venv ".venv-sglang-$VERSION" \
    || { echo "check_sglang: sglang $VERSION: install failed"; exit 2; }
  PY=".venv-sglang-$VERSION/bin/python"
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
DFLASH_E2E_SERIAL=1 DFLASH_E2E_ENGINES=$ENGINES "$PY" -m pytest -q -ra -p no:cacheprovider \
  tests/test_sglang_versions.py tests/test_sglang_plugin.py tests/test_sglang_tree.py tests/test_sglang_simulate.py \
  tests/test_adaptive.py tests/test_sglang_e2e.py \
  -k "not test_sglang_e2e or ((chain or tree or goodput) and not tensor_parallel and not data_parallel)" \
  2>&1 | tee "$log" || rc=$?
counts=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -1 | tr -d '=' | xargs)  # pytest's summary line
echo "check_sglang: sglang $VERSION: ${counts:-no summary}; $(( $(date +%s) - start )) s in all, exit $rc"
exit "$rc"
