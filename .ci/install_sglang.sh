#!/usr/bin/env bash
# Installs SGLang for the CPU end-to-end tests (tests/test_sglang_*.py), without CUDA.
#
#   bash .ci/install_sglang.sh [VERSION] [--venv DIR]
#
# VERSION: any SGLang release 0.5.17 .. 0.5.23 (default 0.5.23, the newest supported). --venv DIR: install into a
# virtualenv at DIR layered over the *current* environment (the base interpreter, an activated virtualenv or a conda
# env: .ci/layered_venv.py), so it shares the CPU torch, the test packages and the project, and shadows only SGLang's
# pins.
#
# SGLang's own requirements pin a CUDA torch, flashinfer, triton and other GPU packages, so sglang is installed
# --no-deps and then exactly the pure-Python packages its import chain and a CPU `sgl.Engine(device="cpu",
# attention_backend="torch_native")` need, at the versions that SGLang release pins. triton, torchvision and
# vllm._custom_ops are NOT installed: the tests put import shims for them on the path (tests/sglang_shims). torch is
# pinned to what is installed (a constraints file), so pip can never swap in a CUDA build. Idempotent: a second run
# only checks and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

SGLANG_VERSION=0.5.23
VENV=""
SYSTEM_LIBS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV="$2"; shift 2 ;;
    0.5.*) SGLANG_VERSION="$1"; shift ;;
    *) echo "install_sglang: unknown argument $1 (usage: install_sglang.sh [0.5.17..0.5.23] [--venv DIR])" >&2
       exit 2 ;;
  esac
done

# Pure-Python (or CPU wheel) imports of every release on the Engine and HTTP-server paths; versions as tested.
COMMON=(
  "apache-tvm-ffi==0.1.11" "fastapi==0.165.0" "uvicorn==0.54.0" "aiohttp==3.14.5" "pyzmq==27.3.0" "msgspec==0.22.0"
  "dill==0.4.1" "uvloop==0.23.0" "pybase64==1.5.1" "psutil==7.2.2" "pillow==13.0.0" "partial_json_parser==0.2.1.1.post7"
  "einops==0.8.2" "loguru==0.7.3" "setproctitle==1.3.8" "requests" "ipython" "gguf" "jiter" "orjson"
  "python-multipart" "soundfile==0.13.1" "jsonschema==4.26.0"  # jsonschema: the OpenAI chat endpoint (HTTP server)
  "prometheus-client==0.23.1"  # --enable-metrics (SGLang's collectors and ours, adapter/step/metrics.py)
  "sglang-router==0.3.2"  # the load balancer users put in front of several servers (the router e2e test)
  "datasets==5.2.0"  # SGLang's benchmark client (sglang.benchmark.serving) imports it at start (its MMMU loader)
)
# Each release's own pins (its wheel's METADATA); where a release leaves a package unpinned, the version tested with
# the release before it. The patch number N of 0.5.N picks the pins (0.5.17 .. 0.5.23).
case "$SGLANG_VERSION" in
  0.5.1[7-9]|0.5.2[0-3]) n=${SGLANG_VERSION##*.} ;;  # (0.5.22 and 0.5.23 require Python >= 3.11)
  *) echo "install_sglang: SGLang $SGLANG_VERSION is not supported (0.5.17 .. 0.5.23)" >&2; exit 2 ;;
esac
pick() { [ "$n" -ge "$2" ] && echo "$3" || echo "$1"; }  # pick OLD FROM NEW: NEW from release 0.5.FROM on
XGRAMMAR=$(pick 0.2.1 21 0.2.7)
COMPRESSED=$(pick 0.20.0 19 0.18.0)  # unpinned by 0.5.17 and 0.5.18 (0.20.0 as tested), 0.18.0 from 0.5.19
TRANSFORMERS=$(pick 5.12.1 22 5.19.0)
OPENAI=$(pick 2.6.1 23 2.8.0)
SENTENCEPIECE=$(pick 0.2.3 21 0.2.1)  # unpinned before 0.5.21 (0.2.3 as tested)
NO_DEPS=("sglang==$SGLANG_VERSION" "xgrammar==$XGRAMMAR" "compressed-tensors==$COMPRESSED")  # xgrammar declares triton
WITH_DEPS=("transformers==$TRANSFORMERS" "openai==$OPENAI" "sentencepiece==$SENTENCEPIECE" "${COMMON[@]}")
if [ "$n" -ge 19 ]; then  # unpinned before 0.5.19 (transformers picks it)
  WITH_DEPS+=("tokenizers==$(pick 0.22.2 22 0.23.2)")
fi
if [ "$n" -ge 20 ]; then  # releases with a DFLASH path for PD disaggregation (adapter/versions.py)
  WITH_DEPS+=("mooncake-transfer-engine-non-cuda==0.3.13.post1")  # its KV transfer (over TCP here)
  SYSTEM_LIBS=(libibverbs1 libnl-3-200 libnl-route-3-200)  # mooncake's engine links libibverbs, even for TCP
fi

# Debian libraries a package's binary links (root installs them; elsewhere the test that needs them says what's missing)
for lib in "${SYSTEM_LIBS[@]:-}"; do
  [ -n "$lib" ] || continue
  if ! dpkg -s "$lib" >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install_sglang: installing the system libraries ${SYSTEM_LIBS[*]} (apt-get)"
    # (one apt-get at a time: .ci/run's newcomer step installs beside the main one; flock waits for the other)
    flock /tmp/dflash-ci-apt.lock sh -c 'apt-get update -qq && apt-get install -y -qq "$@" >/dev/null' sh \
      "${SYSTEM_LIBS[@]}" || echo "install_sglang: apt-get failed" >&2
    break
  fi
done

PY=python
if [ -n "$VENV" ]; then
  python .ci/layered_venv.py "$VENV" >/dev/null  # (re)writes its link to this environment every run
  PY="$VENV/bin/python"
fi

check() {
  PYTHONPATH="tests/sglang_shims${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$SGLANG_VERSION" <<'EOF'
import sys
from importlib.metadata import version

assert version("sglang") == sys.argv[1], version("sglang")
from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (the whole import chain)
import sglang.launch_server  # noqa: F401
from sglang.srt.entrypoints.openai import serving_chat  # noqa: F401
import xgrammar  # noqa: F401
EOF
}

# Fast path: every package above is installed at its pinned version (metadata only, no imports).
installed() {
  "$PY" - "${NO_DEPS[@]}" "${WITH_DEPS[@]}" <<'EOF'
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

where="${VENV:+$VENV (layered over $(python -c 'import sys; print(sys.prefix)'))}"
where="${where:-$(python -c 'import sys; print(sys.prefix)')}"
if installed; then
  echo "install_sglang: sglang ${SGLANG_VERSION} and its CPU test deps already installed in ${where}"
  exit 0
fi

echo "install_sglang: installing sglang ${SGLANG_VERSION} (--no-deps) and its CPU test deps into ${where}"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PY" - >"$constraints" <<'EOF'
from importlib.metadata import version
print(f"torch=={version('torch').split('+')[0]}")
EOF

# pip reports sglang's undeclared-on-purpose requirements (CUDA torch, flashinfer, ...) as conflicts: expected.
quiet_conflicts() { grep -v -e "^sglang ${SGLANG_VERSION} requires" -e "dependency resolver does not currently" \
                            -e "^WARNING: Location" -e "requires triton" >&2 || true; }
"$PY" -m pip install -q -c "$constraints" --no-deps "${NO_DEPS[@]}" 2> >(quiet_conflicts)
"$PY" -m pip install -q -c "$constraints" "${WITH_DEPS[@]}" 2> >(quiet_conflicts)
check 2>/dev/null || { echo "install_sglang: sglang still does not import:" >&2; check; }
echo "install_sglang: sglang ${SGLANG_VERSION} installed in ${where}"
