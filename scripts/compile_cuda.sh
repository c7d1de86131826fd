#!/usr/bin/env bash
# Compile-check every cuda/*.cu for sm_90a (Hopper) and sm_100a (Blackwell) with ptxas statistics, and
# build cuda/host_harness.cpp (the kernels' per-request logic, built for the CPU tests) with the host compiler.
# Prints one "registers / spills / smem" line per kernel and arch; exits non-zero on any compiler error.
# Without nvcc it prints a SKIP line and exits 0 (CPU-only CI). Usage: scripts/compile_cuda.sh [nvcc args...]
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [[ -z "$NVCC" ]]; then
  echo "SKIP compile_cuda: nvcc not found (set CUDA_HOME or put nvcc on PATH)"
  exit 0
fi
ARCHS=(90a 100a)
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
echo "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*'))"

status=0
for src in cuda/*.cu; do
  for arch in "${ARCHS[@]}"; do
    log="$OUT/$(basename "$src" .cu).sm_$arch.log"
    if ! "$NVCC" -std=c++17 -O3 -lineinfo -Xptxas -v -gencode "arch=compute_$arch,code=sm_$arch" \
        -c "$src" -o "$OUT/$(basename "$src").sm_$arch.o" "$@" >"$log" 2>&1; then
      echo "FAIL $src sm_$arch"; cat "$log"; status=1; continue
    fi
    if grep -qiE "warning|error" "$log"; then grep -iE "warning|error" "$log"; fi
    # ptxas prints, per entry: "Compiling entry function '<mangled>'", then spills, then registers/smem.
    awk -v src="$src" -v arch="sm_$arch" '
      /Compiling entry function/ { match($0, /'"'"'[^'"'"']*'"'"'/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
      /spill stores/ { split($0, a, ","); stores = a[2]; loads = a[3]; gsub(/^ +| bytes spill (stores|loads)/, "", stores); gsub(/^ +| bytes spill (stores|loads)/, "", loads) }
      /Used [0-9]+ registers/ {
        match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15)
        smem = "0"; if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11)
        printf "%-22s %-8s regs %3s  spill st/ld %s/%s B  smem %6s B  %s\n", src, arch, regs, stores, loads, smem, fn
      }' "$log"
  done
done

CXX="${CXX:-g++}"
if command -v "$CXX" >/dev/null; then
  if ! "$CXX" -std=c++17 -O2 -ffp-contract=off -Wall -Wextra -shared -fPIC cuda/host_harness.cpp \
      -o "$OUT/host_harness.so" 2>"$OUT/host.log"; then
    echo "FAIL cuda/host_harness.cpp ($CXX)"; cat "$OUT/host.log"; status=1
  else
    [[ -s "$OUT/host.log" ]] && cat "$OUT/host.log"
    echo "cuda/host_harness.cpp  host     ok ($CXX)"
  fi
fi
[[ $status -eq 0 ]] && echo "compile_cuda: OK" || echo "compile_cuda: FAILED"
exit $status
