// build_tree: best-first draft tree from one DFlash pass. Reference: dflash_sglang/core/step/tree.py.
//
// One warp per request. Node s (score, depth, path key) owns K lattice children; step n takes the best
// child not yet taken among nodes 0..n-1, so nodes come out in selection order and parents precede
// children. A node's children share its depth and key prefix, so among them the order is (log-prob desc,
// rank asc): each position's K candidates are sorted that way once, a node's taken children are always a
// prefix of that order, and its best untaken child is simply the next one. A step therefore scans n
// candidates (one per node, split across the lanes) instead of n*K, then does one warp argmax; the
// reference scans the whole frontier and the tests check the two agree.
// The per-request logic is written against a `Group` (lanes + barrier + argmax) so host_harness.cpp can
// run the identical code with a single serial lane.
#pragma once

#include "common.cuh"

namespace dflash {

struct BuildTreeParams {
  IndexView root;              // [bs]: bonus token = node 0
  const int64_t* topk_tokens;  // [bs, D, K]: candidates of block positions 1..D
  const float* topk_logp;      // [bs, D, K]: their log-probs
  int64_t bs, depth, k, n;     // D, K, N
  int64_t* tokens;             // [bs, N]
  int64_t* parent;             // [bs, N], -1 for the root
  int64_t* node_depth;         // [bs, N]
  float* score;                // [bs, N]: path log-prob
  uint8_t* mask;               // [bs, N, N] bool: node i attends to node j
  int64_t* retrive_index;      // [bs, N]: b * N + i
  int64_t* retrive_next_token; // [bs, N]: first child or -1
  int64_t* retrive_next_sibling;  // [bs, N]: next sibling or -1
};

struct Candidate {
  float score;
  int depth;
  int64_t key;  // candidate ranks along the path as base-K digits: lexicographic order within a depth
  int node;     // the parent offering this child; -1 = no candidate
};

// Total order of core/step/tree.py: score desc, depth asc, path key asc (keys are unique within a depth).
DFLASH_HD bool better(const Candidate& a, const Candidate& b) {
  if (a.node < 0) return false;
  if (b.node < 0) return true;
  if (a.score != b.score) return a.score > b.score;
  if (a.depth != b.depth) return a.depth < b.depth;
  return a.key < b.key;
}

// One request's state (shared memory on the GPU), 8-byte arrays first for alignment.
struct TreeScratch {
  int64_t* key;      // [N]
  float* score;      // [N]
  int* depth;        // [N]
  int* parent;       // [N]
  int* next;         // [N]: how many of the node's children (in sorted order) are taken
  float* logp;       // [D, K]: each position's log-probs, sorted (desc, rank asc)
  int* rank;         // [D, K]: their original candidate ranks
  uint32_t* anc;     // [N, words]: ancestor-or-self bitsets (the attention mask rows)
  int words;
};

DFLASH_HD int64_t tree_scratch_bytes(int64_t n, int64_t d, int64_t k) {
  const int64_t words = (n + 31) / 32;
  return n * (8 + 4 * 4) + d * k * (4 + 4) + n * words * 4;
}

DFLASH_HD TreeScratch carve_tree_scratch(unsigned char* base, int64_t n, int64_t d, int64_t k) {
  TreeScratch s;
  s.words = int((n + 31) / 32);
  s.key = reinterpret_cast<int64_t*>(base);
  s.score = reinterpret_cast<float*>(s.key + n);
  s.depth = reinterpret_cast<int*>(s.score + n);
  s.parent = s.depth + n;
  s.next = s.parent + n;
  s.logp = reinterpret_cast<float*>(s.next + n);
  s.rank = reinterpret_cast<int*>(s.logp + d * k);
  s.anc = reinterpret_cast<uint32_t*>(s.rank + d * k);
  return s;
}

struct SerialGroup {
  DFLASH_HD int rank() const { return 0; }
  DFLASH_HD int size() const { return 1; }
  DFLASH_HD void sync() const {}
  DFLASH_HD Candidate best(const Candidate& c) const { return c; }
};

template <class Group>
DFLASH_HD void build_tree_request(const BuildTreeParams& p, int64_t b, const TreeScratch& s, const Group& g) {
  const int N = int(p.n), D = int(p.depth), K = int(p.k), W = s.words;
  const int64_t row = b * N;
  const float* logp = p.topk_logp + b * D * K;
  const int64_t* cand_tokens = p.topk_tokens + b * D * K;
  for (int d = g.rank(); d < D; d += g.size()) {  // stable insertion sort of one position's K candidates
    float* lp = s.logp + d * K;
    int* rk = s.rank + d * K;
    for (int i = 0; i < K; ++i) {
      const float x = logp[d * K + i];
      int j = i - 1;
      for (; j >= 0 && lp[j] < x; --j) {
        lp[j + 1] = lp[j];
        rk[j + 1] = rk[j];
      }
      lp[j + 1] = x;
      rk[j + 1] = i;
    }
  }
  for (int w = g.rank(); w < W; w += g.size()) s.anc[w] = w == 0 ? 1u : 0u;  // the root sees itself
  if (g.rank() == 0) {
    s.key[0] = 0;
    s.score[0] = 0.f;
    s.depth[0] = 0;
    s.parent[0] = -1;
    s.next[0] = 0;
  }
  g.sync();
  for (int n = 1; n < N; ++n) {
    Candidate best{0.f, 0, 0, -1};
    for (int node = g.rank(); node < n; node += g.size()) {
      const int d = s.depth[node], i = s.next[node];
      if (d >= D || i >= K) continue;
      const int r = s.rank[d * K + i];
      const Candidate cand{add_rn(s.score[node], s.logp[d * K + i]), d + 1, s.key[node] * K + r, node};
      if (better(cand, best)) best = cand;
    }
    best = g.best(best);
    if (best.node < 0) break;  // unreachable: the launcher checks N <= 1 + K + ... + K^D
    const int par = best.node;
    g.sync();  // every lane has read s.next[par] before lane 0 advances it
    if (g.rank() == 0) {
      s.next[par] += 1;
      s.next[n] = 0;
      s.key[n] = best.key;
      s.score[n] = best.score;
      s.depth[n] = best.depth;
      s.parent[n] = par;
    }
    for (int w = g.rank(); w < W; w += g.size()) {
      s.anc[n * W + w] = s.anc[par * W + w] | (w == n / 32 ? 1u << (n % 32) : 0u);
    }
    g.sync();
  }
  for (int i = g.rank(); i < N; i += g.size()) {
    const int d = s.depth[i], par = s.parent[i];
    int first_child = -1, next_sibling = -1;
    for (int j = i + 1; j < N && first_child < 0; ++j) first_child = s.parent[j] == i ? j : -1;
    for (int j = i + 1; j < N && i > 0 && next_sibling < 0; ++j) next_sibling = s.parent[j] == par ? j : -1;
    p.tokens[row + i] = i == 0 ? p.root[b] : cand_tokens[(d - 1) * K + int(s.key[i] % K)];
    p.parent[row + i] = par;
    p.node_depth[row + i] = d;
    p.score[row + i] = s.score[i];
    p.retrive_index[row + i] = row + i;
    p.retrive_next_token[row + i] = first_child;
    p.retrive_next_sibling[row + i] = next_sibling;
  }
  for (int i = 0; i < N; ++i) {  // lanes sweep columns: coalesced row writes
    for (int j = g.rank(); j < N; j += g.size()) {
      p.mask[(row + i) * N + j] = uint8_t((s.anc[i * W + j / 32] >> (j % 32)) & 1u);
    }
  }
}

inline int check_build_tree(const BuildTreeParams& p) {
  DFLASH_CHECK(p.bs >= 0 && p.depth >= 1 && p.k >= 1, "build_tree: need bs >= 0, D >= 1, K >= 1, got %lld %lld %lld",
               (long long)p.bs, (long long)p.depth, (long long)p.k);
  DFLASH_CHECK(p.n >= 1 && p.n <= kMaxNodes, "build_tree: N must be in [1, %lld], got %lld", (long long)kMaxNodes,
               (long long)p.n);
  int64_t lattice = 1, level = 1, key_range = 1;
  for (int64_t d = 0; d < p.depth && lattice < p.n; ++d) lattice += (level *= p.k);
  for (int64_t d = 0; d < p.depth; ++d) {
    DFLASH_CHECK(key_range <= INT64_MAX / p.k, "build_tree: K**D must be < 2**63 (path keys are int64)");
    key_range *= p.k;
  }
  DFLASH_CHECK(p.n <= lattice, "build_tree: N=%lld exceeds the %lld-node lattice", (long long)p.n, (long long)lattice);
  DFLASH_CHECK(valid_index(p.root, true) && p.topk_tokens && p.topk_logp, "build_tree: missing inputs");
  DFLASH_CHECK(p.tokens && p.parent && p.node_depth && p.score && p.mask && p.retrive_index && p.retrive_next_token &&
                   p.retrive_next_sibling,
               "build_tree: missing outputs");
  return 0;
}

#ifdef __CUDACC__
struct WarpGroup {
  __device__ int rank() const { return threadIdx.x & 31; }
  __device__ int size() const { return 32; }
  __device__ void sync() const { __syncwarp(); }
  // Butterfly argmax: `better` is a strict total order on valid candidates (one per node, keys unique within
  // a depth), so every lane ends with the same winner.
  __device__ Candidate best(Candidate c) const {
    for (int offset = 16; offset > 0; offset >>= 1) {
      Candidate o;
      o.score = __shfl_xor_sync(0xffffffffu, c.score, offset);
      o.depth = __shfl_xor_sync(0xffffffffu, c.depth, offset);
      o.key = __shfl_xor_sync(0xffffffffu, (long long)c.key, offset);
      o.node = __shfl_xor_sync(0xffffffffu, c.node, offset);
      if (better(o, c)) c = o;
    }
    return c;
  }
};

__global__ void __launch_bounds__(32) build_tree_kernel(BuildTreeParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  build_tree_request(p, blockIdx.x, carve_tree_scratch(smem, p.n, p.depth, p.k), WarpGroup{});
}
#endif

}  // namespace dflash
