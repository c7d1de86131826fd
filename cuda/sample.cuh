// Inverse-CDF sampling that reproduces dflash_sglang/core/step/accept.py::sample_from bit for bit.
//
// The definition: torch's CPU cumsum of float32 accumulates sequentially in double and rounds every prefix
// to float32 (pinned by tests/test_tree.py); the pick is the first index whose prefix exceeds
// u * total (a float32 product), clamped to the last positive weight. Adding 0.0 changes no prefix, so
// zero weights are skipped everywhere.
//
// A sequential double scan over a 150k vocab is ~0.6 ms on one GPU thread, so the block sampler first runs
// a parallel scan (per-thread chunks + a block scan, also in double) and *certifies* its answer: every
// prefix it computed is within eps * prefix of the sequential one (both are sums of non-negative terms; eps
// counts the roundings on either side, with a factor 2 of margin), and when the float32 roundings of the
// prefixes just below and at the pick, and of the total, cannot change within that interval, the parallel
// pick *is* the sequential pick (the float32 prefixes are monotone). Otherwise, with probability ~1e-3
// per dense 150k-token row, it falls back to the sequential definition, staged through shared memory.
#pragma once

#include "common.cuh"

namespace dflash {

// Membership in a sorted list of zeroed tokens for a reader that visits indices in increasing order.
struct RejectedCursor {
  const int64_t* rejected;
  int64_t count;
  int64_t next;

  DFLASH_HD RejectedCursor(const int64_t* r, int64_t n) : rejected(r), count(n), next(0) {}
  DFLASH_HD bool hit(int64_t j) {
    while (next < count && rejected[next] < j) ++next;
    return next < count && rejected[next] == j;
  }
};

struct PrefixScan {
  double acc = 0.0;
  DFLASH_HD float push(float w) {
    acc += double(w);
    return float(acc);
  }
};

// The sequential definition (host harness). -1 when no weight is positive.
DFLASH_HD int64_t sample_serial(const float* w, int64_t vocab, const int64_t* rejected, int64_t n_rejected, float u) {
  RejectedCursor total_cursor(rejected, n_rejected);
  PrefixScan total;
  int64_t last = -1;
  for (int64_t j = 0; j < vocab; ++j) {
    const float x = total_cursor.hit(j) ? 0.f : w[j];
    if (x > 0.f) {
      total.push(x);
      last = j;
    }
  }
  if (last < 0) return -1;
  const float threshold = mul_rn(u, float(total.acc));
  RejectedCursor cursor(rejected, n_rejected);
  PrefixScan prefix;
  for (int64_t j = 0; j < last; ++j) {
    const float x = cursor.hit(j) ? 0.f : w[j];
    if (x > 0.f && prefix.push(x) > threshold) return j;
  }
  return last;
}

DFLASH_HD bool rounds_like_neighbours(double x, double eps) {
  const double e = x * eps;
  return float(x - e) == float(x + e);
}

}  // namespace dflash

#ifdef __CUDACC__
#include <climits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace dflash {

struct MaxOp {
  __device__ long long operator()(long long a, long long b) const { return a > b ? a : b; }
};

template <int T>
struct SamplerShared {
  union {
    typename cub::BlockScan<double, T>::TempStorage scan;
    typename cub::BlockReduce<long long, T>::TempStorage reduce;
    float stage[4 * T];  // sequential fallback: one tile of weights
  } tmp;
  double below, above;  // parallel prefixes just before and at the pick
  long long nnz, last, result;
  int found;
  bool done;
};

// The sequential definition on thread 0, fed through shared-memory tiles that the whole block loads.
template <int T>
__device__ long long sample_tiled(const float* w, long long vocab, const int64_t* rejected, int64_t n_rejected,
                                  float u, SamplerShared<T>& sh) {
  constexpr int kTile = 4 * T;
  long long last = -1, pick = -1;
  float threshold = 0.f;
  for (int pass = 0; pass < 2; ++pass) {  // pass 0: total and last positive weight; pass 1: the pick
    RejectedCursor cursor(rejected, n_rejected);
    PrefixScan prefix;
    for (long long base = 0; base < vocab; base += kTile) {
      for (int q = threadIdx.x; q < kTile; q += T) {
        const long long j = base + q;
        sh.tmp.stage[q] = j < vocab && !cursor.hit(j) ? w[j] : 0.f;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int q = 0; q < kTile; ++q) {
          const float x = sh.tmp.stage[q];
          if (!(x > 0.f)) continue;
          const float c = prefix.push(x);
          if (pass == 0) {
            last = base + q;
          } else if (c > threshold) {
            pick = base + q;
            break;
          }
        }
        sh.done = pick >= 0;
      }
      __syncthreads();
      if (sh.done) break;
    }
    if (threadIdx.x == 0 && pass == 0) threshold = mul_rn(u, float(prefix.acc));
  }
  if (threadIdx.x == 0) sh.result = pick >= 0 ? pick : (last >= 0 ? last : vocab - 1);
  __syncthreads();
  return sh.result;
}

// Block-wide sample_from of w [vocab] with the sorted `rejected` tokens zeroed. Every thread of the block
// must call it; returns -1 (to all threads) when no weight is positive.
template <int T>
__device__ long long sample_block(const float* w, long long vocab, const int64_t* rejected, int64_t n_rejected,
                                  float u, bool sequential_only, SamplerShared<T>& sh) {
  const long long chunk = (vocab + T - 1) / T;
  const long long lo = min(vocab, threadIdx.x * chunk), hi = min(vocab, lo + chunk);
  double sum = 0.0;
  long long nnz = 0, last = -1;
  {
    RejectedCursor cursor(rejected, n_rejected);
    for (long long j = lo; j < hi; ++j) {
      const float x = cursor.hit(j) ? 0.f : w[j];
      if (x > 0.f) {
        sum += double(x);
        ++nnz;
        last = j;
      }
    }
  }
  double before, total;
  cub::BlockScan<double, T>(sh.tmp.scan).ExclusiveSum(sum, before, total);
  __syncthreads();
  const long long nnz_all = cub::BlockReduce<long long, T>(sh.tmp.reduce).Sum(nnz);
  __syncthreads();
  const long long last_all = cub::BlockReduce<long long, T>(sh.tmp.reduce).Reduce(last, MaxOp{});
  if (threadIdx.x == 0) {
    sh.nnz = nnz_all;
    sh.last = last_all;
    sh.found = INT_MAX;
  }
  __syncthreads();
  if (sh.nnz == 0) return -1;

  // Roundings on the sequential side (<= nnz) plus ours (chunk sum, block scan, re-scan), x2 margin.
  const double eps = double(sh.nnz + 2 * chunk + T + 64) * 0x1p-52;
  const float total_f = float(total), threshold = mul_rn(u, total_f);
  long long pick = -1;
  double below = 0.0, above = 0.0;
  if (!sequential_only && float(before) <= threshold && float(before + sum) > threshold) {
    RejectedCursor cursor(rejected, n_rejected);
    double acc = before;
    for (long long j = lo; j < hi; ++j) {
      const float x = cursor.hit(j) ? 0.f : w[j];
      if (!(x > 0.f)) continue;
      below = acc;
      acc += double(x);
      if (float(acc) > threshold) {
        pick = j;
        above = acc;
        break;
      }
    }
    if (pick >= 0) atomicMin(&sh.found, int(pick));
  }
  __syncthreads();
  if (pick >= 0 && pick == sh.found) {
    sh.below = below;
    sh.above = above;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool exact = !sequential_only && rounds_like_neighbours(total, eps);
    if (sh.found != INT_MAX) {
      exact = exact && rounds_like_neighbours(sh.below, eps) && rounds_like_neighbours(sh.above, eps);
      sh.result = sh.found;
    } else {  // no prefix crosses: sample_from clamps to the last positive weight
      exact = exact && !(total_f > threshold);
      sh.result = sh.last;
    }
    sh.done = exact;
  }
  __syncthreads();
  if (sh.done) return sh.result;
  return sample_tiled<T>(w, vocab, rejected, n_rejected, u, sh);
}

}  // namespace dflash
#endif
