// verify_tree: greedy or lossless-sampling verification of a draft tree against the target's outputs at
// every node. Reference: dflash_sglang/core/step/tree_verify.py (the rules and output conventions are there).
//
// One block per request: the block loads the request's nodes (and, for sampling, each node's draft-token
// probability under its parent's distribution) into shared memory, thread 0 walks the tree from there
// (<= N shared-memory reads per level, no global loads on the critical path), then for sampling the whole
// block draws the bonus token from the final node's residual (sample.cuh).
#pragma once

#include "common.cuh"
#include "sample.cuh"

namespace dflash {

struct VerifyTreeParams {
  const int64_t* tokens;        // [bs, N]: node tokens (node 0 = root)
  const int64_t* parent;        // [bs, N]: parent ids, parent[i] < i
  int64_t bs, n, max_depth;     // outputs per request hold D + 1 entries
  IndexView target_argmax;      // greedy: [bs, N] target argmax after each node (absent for sampling)
  const float* target_probs;    // sampling: [bs, N, V] target distribution after each node
  const float* coins;           // sampling: [bs, N] uniforms, index = node id
  const float* resample_u;      // sampling: [bs] uniform for the bonus token
  int64_t vocab;                // V
  int64_t sequential_sampler;   // 1: skip the certified parallel pass (lets tests reach the fallback)
  IndexView out_cache_loc;      // [bs, N] KV slot of each node, or absent
  int64_t* accept_len;          // [bs]: accepted non-root nodes
  int64_t* accept_nodes;        // [bs, D+1]: root, accepted path, -1
  int64_t* out_tokens;          // [bs, D+1]: accepted draft tokens, bonus, -1
  int64_t* bonus;               // [bs]
  int64_t* commit_loc;          // [bs, D+1]: slots of accept_nodes, -1 (with out_cache_loc)
  int64_t* free_loc;            // [bs, N-1]: slots of the other nodes in node order, -1 (with out_cache_loc)
};

struct VerifyScratch {  // one request, shared memory on the GPU
  int64_t tok[kMaxNodes];
  int64_t want[kMaxNodes];      // greedy: target argmax after node i
  int64_t rejected[kMaxNodes];  // sampling: tokens rejected at the final node, sorted ascending
  float p_draft[kMaxNodes];     // sampling: p_parent(tok[i]), the probability the acceptance test reads
  float coin[kMaxNodes];
  int par[kMaxNodes];
  int path[kMaxNodes];
  uint8_t on_path[kMaxNodes];
  int len, n_rejected;
};

template <bool kSampling>
DFLASH_HD void load_request(const VerifyTreeParams& p, int64_t b, VerifyScratch& s, int rank, int size) {
  const int64_t row = b * p.n;
  for (int i = rank; i < p.n; i += size) {
    const int64_t tok = p.tokens[row + i], par = p.parent[row + i];
    s.tok[i] = tok;
    s.par[i] = int(par);
    if constexpr (kSampling) {
      const bool inside = i > 0 && par >= 0 && par < i && tok >= 0 && tok < p.vocab;  // malformed nodes never accept
      s.coin[i] = p.coins[row + i];
      s.p_draft[i] = inside ? p.target_probs[(row + par) * p.vocab + tok] : 0.f;
    } else {
      s.want[i] = p.target_argmax[row + i];
    }
  }
}

// Thread 0: the accepted path, and for sampling the sorted tokens rejected at its last node.
template <bool kSampling>
DFLASH_HD void walk_tree(const VerifyTreeParams& p, VerifyScratch& s) {
  int cur = 0, len = 0, n_rejected = 0;
  s.path[0] = 0;
  for (int level = 1; level <= p.max_depth; ++level) {
    float removed = 0.f;  // residual mass zeroed at this node so far
    int next = -1;
    for (int j = cur + 1; j < p.n && next < 0; ++j) {  // children follow their parent: node order
      if (s.par[j] != cur) continue;
      if constexpr (kSampling) {
        float r = s.p_draft[j];
        for (int q = 0; q < n_rejected; ++q) r = s.rejected[q] == s.tok[j] ? 0.f : r;
        if (mul_rn(s.coin[j], sub_rn(1.f, removed)) < r) {
          next = j;
        } else {
          removed = add_rn(removed, r);
          s.rejected[n_rejected++] = s.tok[j];
        }
      } else {
        next = s.tok[j] == s.want[cur] ? j : -1;
      }
    }
    if (next < 0) break;
    cur = next;
    s.path[++len] = cur;
    n_rejected = 0;  // a new current node: its residual starts as its own distribution
  }
  for (int i = 1; i < n_rejected; ++i) {  // insertion sort: at most a node's children
    const int64_t x = s.rejected[i];
    int j = i - 1;
    for (; j >= 0 && s.rejected[j] > x; --j) s.rejected[j + 1] = s.rejected[j];
    s.rejected[j + 1] = x;
  }
  for (int i = 0; i < p.n; ++i) s.on_path[i] = 0;
  for (int j = 0; j <= len; ++j) s.on_path[s.path[j]] = 1;
  s.len = len;
  s.n_rejected = n_rejected;
}

DFLASH_HD void write_verify_outputs(const VerifyTreeParams& p, int64_t b, const VerifyScratch& s, int64_t bonus,
                                    int rank, int size) {
  const int64_t width = p.max_depth + 1, row = b * p.n, len = s.len;
  for (int64_t j = rank; j < width; j += size) {
    const bool on = j <= len;
    p.accept_nodes[b * width + j] = on ? s.path[j] : -1;
    p.out_tokens[b * width + j] = j < len ? s.tok[s.path[j + 1]] : (j == len ? bonus : -1);
    if (p.commit_loc != nullptr) p.commit_loc[b * width + j] = on ? p.out_cache_loc[row + s.path[j]] : -1;
  }
  if (rank != 0) return;
  p.accept_len[b] = len;
  p.bonus[b] = bonus;
  if (p.free_loc == nullptr) return;
  int64_t q = 0;
  for (int64_t i = 0; i < p.n; ++i) {
    if (!s.on_path[i]) p.free_loc[b * (p.n - 1) + q++] = p.out_cache_loc[row + i];
  }
  for (; q < p.n - 1; ++q) p.free_loc[b * (p.n - 1) + q] = -1;
}

inline int check_verify_tree(const VerifyTreeParams& p) {
  DFLASH_CHECK(p.bs >= 0 && p.n >= 1 && p.n <= kMaxNodes && p.max_depth >= 0,
               "verify_tree: need bs >= 0, 1 <= N <= %lld, D >= 0, got bs=%lld N=%lld D=%lld", (long long)kMaxNodes,
               (long long)p.bs, (long long)p.n, (long long)p.max_depth);
  DFLASH_CHECK(p.tokens && p.parent, "verify_tree: missing tree tokens / parent");
  const bool sampling = p.target_probs != nullptr;
  DFLASH_CHECK(sampling != p.target_argmax.present(), "verify_tree: pass exactly one of target_argmax / target_probs");
  if (sampling) {
    DFLASH_CHECK(p.coins && p.resample_u && p.vocab >= 1 && p.vocab < INT32_MAX,
                 "verify_tree: sampling needs coins, resample_u and 1 <= V < 2**31, got V=%lld", (long long)p.vocab);
  } else {
    DFLASH_CHECK(valid_index(p.target_argmax, true), "verify_tree: target_argmax must be int32 or int64");
  }
  DFLASH_CHECK(valid_index(p.out_cache_loc, false), "verify_tree: out_cache_loc must be int32 or int64");
  DFLASH_CHECK((p.commit_loc != nullptr) == p.out_cache_loc.present() &&
                   (p.free_loc != nullptr) == p.out_cache_loc.present(),
               "verify_tree: commit_loc / free_loc outputs come with out_cache_loc");
  DFLASH_CHECK(p.accept_len && p.accept_nodes && p.out_tokens && p.bonus, "verify_tree: missing outputs");
  return 0;
}

#ifdef __CUDACC__
constexpr int kGreedyThreads = 64;
constexpr int kSamplingThreads = 512;

template <bool kSampling, int T>
__global__ void __launch_bounds__(T) verify_tree_kernel(VerifyTreeParams p) {
  __shared__ VerifyScratch s;
  const int64_t b = blockIdx.x;
  load_request<kSampling>(p, b, s, threadIdx.x, T);
  __syncthreads();
  if (threadIdx.x == 0) walk_tree<kSampling>(p, s);
  __syncthreads();
  int64_t bonus;
  if constexpr (kSampling) {
    __shared__ SamplerShared<T> sh;
    const float* w = p.target_probs + (b * p.n + s.path[s.len]) * p.vocab;
    const float u = p.resample_u[b];
    const bool sequential = p.sequential_sampler != 0;
    long long pick = sample_block<T>(w, p.vocab, s.rejected, s.n_rejected, u, sequential, sh);
    // A residual without mass can only come from rounding: sample the target distribution itself.
    if (pick < 0) pick = sample_block<T>(w, p.vocab, s.rejected, 0, u, sequential, sh);
    bonus = pick < 0 ? p.vocab - 1 : pick;
  } else {
    bonus = s.want[s.path[s.len]];
  }
  write_verify_outputs(p, b, s, bonus, threadIdx.x, T);
}
#endif

}  // namespace dflash
