#!/usr/bin/env bash
# Installs SGLang 0.5.17 for the CPU end-to-end tests (tests/test_sglang_*.py), without CUDA.
#
# SGLang's own requirements pin a CUDA torch (2.11), flashinfer, triton and other GPU packages, so sglang
# is installed --no-deps and then exactly the pure-Python packages its import chain and a CPU
# `sgl.Engine(device="cpu", attention_backend="torch_native")` need. triton, torchvision and
# vllm._custom_ops are NOT installed: the tests put import shims for them on the path
# (tests/sglang_shims). torch is pinned to what is installed (a constraints file), so pip can never swap
# in a CUDA build; transformers is set to the 5.12.1 that sglang 0.5.17 pins. Idempotent: a second run
# only checks and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

SGLANG_VERSION=0.5.17
# Packages whose declared deps would pull GPU wheels (torch, triton): installed without their deps.
NO_DEPS=(
  "sglang==${SGLANG_VERSION}"
  "xgrammar==0.2.1"            # declares triton
  "compressed-tensors==0.20.0" # declares torch>=2.10
)
# Pure-Python (or CPU wheel) imports of sglang 0.5.17 on the Engine path; versions as tested.
WITH_DEPS=(
  "transformers==5.12.1"
  "apache-tvm-ffi==0.1.11" "openai==2.6.1" "fastapi==0.165.0" "uvicorn==0.54.0" "aiohttp==3.14.5"
  "pyzmq==27.3.0" "msgspec==0.22.0" "dill==0.4.1" "uvloop==0.23.0" "pybase64==1.5.1" "psutil==7.2.2"
  "pillow==13.0.0" "partial_json_parser==0.2.1.1.post7" "sentencepiece==0.2.3" "einops==0.8.2"
  "loguru==0.7.3" "setproctitle==1.3.8" "requests" "ipython" "gguf" "jiter" "orjson" "python-multipart"
  "soundfile==0.13.1"  # imported by sglang.launch_server (the HTTP server path the bench tests use)
)

check() {
  PYTHONPATH="tests/sglang_shims${PYTHONPATH:+:$PYTHONPATH}" python - "$SGLANG_VERSION" <<'EOF'
import sys
from importlib.metadata import version

assert version("sglang") == sys.argv[1], version("sglang")
assert version("transformers") == "5.12.1", version("transformers")
from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (the whole import chain)
import xgrammar  # noqa: F401
EOF
}

# Fast path: every package above is installed at its pinned version (metadata only, no imports).
installed() {
  python - "${NO_DEPS[@]}" "${WITH_DEPS[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if want and have != want:
        sys.exit(1)
EOF
}

if installed; then
  echo "install_sglang: sglang ${SGLANG_VERSION} and its CPU test deps already installed"
  exit 0
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
python - >"$constraints" <<'EOF'
from importlib.metadata import version
print(f"torch=={version('torch').split('+')[0]}")
EOF

# pip reports sglang's undeclared-on-purpose requirements (CUDA torch, flashinfer, ...) as conflicts: expected.
quiet_conflicts() { grep -v -e "^sglang ${SGLANG_VERSION} requires" -e "dependency resolver does not currently" >&2 || true; }
python -m pip install -q -c "$constraints" --no-deps "${NO_DEPS[@]}" 2> >(quiet_conflicts)
python -m pip install -q -c "$constraints" "${WITH_DEPS[@]}" 2> >(quiet_conflicts)
check 2>/dev/null || { echo "install_sglang: sglang still does not import:" >&2; check; }
echo "install_sglang: sglang ${SGLANG_VERSION} installed"
