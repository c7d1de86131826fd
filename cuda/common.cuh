// Shared pieces of the dflash kernels. Framework-free: raw pointers and plain structs, no torch.
//
// Everything outside `#ifdef __CUDACC__` is plain C++17 as well: cuda/host_harness.cpp compiles the
// per-request logic with g++ so the CPU tests can run it against the PyTorch references without a GPU.
// Params structs are mirrored field for field by dflash_sglang/ops/_abi.py (ctypes); all scalars are
// int64_t and all pointers are 8 bytes, so the layout has no padding to get wrong.
#pragma once

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __CUDACC__
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash {

// Tree ops keep one request's nodes in shared memory; EAGLE-style trees use <= 128 nodes.
constexpr int64_t kMaxNodes = 256;

// An int32 or int64 index tensor, so callers pass either width without a conversion kernel.
struct IndexView {
  const void* data;  // nullptr = absent (optional input)
  int64_t bytes;     // 4 or 8

  DFLASH_HD bool present() const { return data != nullptr; }
  DFLASH_HD int64_t operator[](int64_t i) const {
    return bytes == 8 ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// float32 ops rounded exactly like the CPU reference rounds each torch op: on the device the _rn
// intrinsics also keep nvcc from contracting a multiply and an add into one FMA.
DFLASH_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DFLASH_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
DFLASH_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// ---- launcher status (host only): launchers return 0 or 1 and leave the message here.
inline thread_local char g_last_error[512];

inline int fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return 1;
}

inline bool valid_index(const IndexView& v, bool required) {
  return v.present() ? (v.bytes == 4 || v.bytes == 8) : !required;
}

}  // namespace dflash

#define DFLASH_CHECK(cond, ...)                      \
  do {                                               \
    if (!(cond)) return ::dflash::fail(__VA_ARGS__); \
  } while (0)

// sizeof a params struct, so the ctypes mirror (dflash_sglang/ops/_abi.py) can refuse a stale library.
#define DFLASH_EXPORT_PARAMS_SIZE(name, type) \
  extern "C" int64_t dflash_##name##_params_size() { return int64_t(sizeof(type)); }

#ifdef __CUDACC__
#include <cuda_runtime.h>

namespace dflash {
// Launch errors surface here; no device sync, so the launchers stay CUDA-graph capturable.
inline int launch_status(const char* op) {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : fail("%s: kernel launch failed: %s", op, cudaGetErrorString(err));
}
}  // namespace dflash
#endif
