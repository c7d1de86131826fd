// build_tree_inputs: the rows a step's verify (a chain is a tree of depth i at node i) feeds to the target.
// Reference: dflash_sglang/core/step/block.py. One thread per (request, row); no reductions.
#pragma once

#include "common.cuh"

namespace dflash {

struct BlockInputsParams {
  IndexView tokens;            // [bs, n]: node tokens
  IndexView depth;             // [bs, n]: node depths
  IndexView seq_lens;          // [bs]: committed tokens = position of row 0
  IndexView req_pool_indices;  // [bs]: row of req_to_token per request (with req_to_token)
  const int32_t* req_to_token; // [R, W] request -> KV slot table, or nullptr (no slot ids)
  int64_t req_to_token_stride; // W
  int64_t req_to_token_rows;   // R
  int64_t bs;
  int64_t n;                   // rows (nodes) per request
  int64_t* input_ids;          // [bs, n]
  int64_t* positions;          // [bs, n]: seq_len + depth
  int64_t* out_cache_loc;      // [bs, n]: req_to_token[req, seq_len + row], present iff req_to_token
};

DFLASH_HD void block_inputs_row(const BlockInputsParams& p, int64_t idx) {
  const int64_t i = idx / p.n, j = idx % p.n;
  const int64_t seq = p.seq_lens[i];
  p.input_ids[idx] = p.tokens[idx];
  p.positions[idx] = seq + p.depth[idx];
  if (p.req_to_token != nullptr) {
    // Out-of-table requests get slot -1 instead of an out-of-bounds read (the reference raises instead).
    const int64_t req = p.req_pool_indices[i], col = seq + j;
    const bool inside = req >= 0 && req < p.req_to_token_rows && col >= 0 && col < p.req_to_token_stride;
    p.out_cache_loc[idx] = inside ? p.req_to_token[req * p.req_to_token_stride + col] : -1;
  }
}

// Structural checks at the C boundary (the Python wrapper has already checked tensors and devices).
inline int check_block_inputs(const BlockInputsParams& p) {
  DFLASH_CHECK(p.bs >= 0 && p.n >= 1, "block_inputs: need bs >= 0 and n >= 1, got bs=%lld n=%lld",
               (long long)p.bs, (long long)p.n);
  DFLASH_CHECK(valid_index(p.tokens, true) && valid_index(p.depth, true) && valid_index(p.seq_lens, true),
               "block_inputs: tokens, depth and seq_lens are required int32 or int64 index tensors");
  DFLASH_CHECK(p.input_ids && p.positions, "block_inputs: input_ids and positions outputs are required");
  if (p.req_to_token != nullptr) {
    DFLASH_CHECK(valid_index(p.req_pool_indices, true) && p.out_cache_loc,
                 "block_inputs: req_to_token needs req_pool_indices and an out_cache_loc output");
    DFLASH_CHECK(p.req_to_token_stride >= p.n && p.req_to_token_rows >= 1,
                 "block_inputs: req_to_token [%lld, %lld] cannot hold %lld rows per request",
                 (long long)p.req_to_token_rows, (long long)p.req_to_token_stride, (long long)p.n);
  }
  return 0;
}

#ifdef __CUDACC__
__global__ void block_inputs_kernel(BlockInputsParams p) {
  const int64_t total = p.bs * p.n;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    block_inputs_row(p, idx);
  }
}
#endif

}  // namespace dflash
