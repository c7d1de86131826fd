// draft_kv_indices: the key rows of one drafter pass over the paged draft pool (page size 1).
// Reference: dflash_sglang/core/block.py draft_kv_indices. One CUDA block per request, its threads striding over
// the request's rows. kv_indptr is read on the device, so a CUDA graph of a fixed batch size can capture the
// launch while the host refills kv_indptr before each replay.
#pragma once

#include "common.cuh"

namespace dflash {

struct DraftLayoutParams {
  const int32_t* kv_indptr;     // [bs+1]: request i's keys are rows kv_indptr[i] .. kv_indptr[i+1]-1 of kv_indices
  IndexView req_pool_indices;   // [bs]: row of req_to_token (and owner of the block scratch) per request
  const int32_t* req_to_token;  // [R, W] request -> KV slot table
  int64_t req_to_token_stride;  // W
  int64_t req_to_token_rows;    // R
  int64_t scratch_base;         // request-pool slot r's block rows are scratch_base + r*block .. + block-1
  int64_t block;
  int64_t bs;
  int64_t capacity;             // kv_indices length; rows past kv_indptr[bs] are left as they are
  int32_t* kv_indices;          // [capacity]
};

// Row t of request i: a context slot for t < kv_len - block, else the request's block scratch row. A context row
// outside the table gets -1, as in the reference (the worker never builds such a layout).
DFLASH_HD void draft_layout_row(const DraftLayoutParams& p, int64_t i, int64_t t) {
  const int64_t start = p.kv_indptr[i], ctx_len = p.kv_indptr[i + 1] - start - p.block;
  const int64_t r = p.req_pool_indices[i];
  int64_t value;
  if (t < ctx_len) {
    const bool inside = r >= 0 && r < p.req_to_token_rows && t < p.req_to_token_stride;
    value = inside ? p.req_to_token[r * p.req_to_token_stride + t] : -1;
  } else {
    value = p.scratch_base + r * p.block + (t - ctx_len);
  }
  if (start + t < p.capacity) p.kv_indices[start + t] = static_cast<int32_t>(value);
}

DFLASH_HD int64_t draft_layout_len(const DraftLayoutParams& p, int64_t i) { return p.kv_indptr[i + 1] - p.kv_indptr[i]; }

inline int check_draft_layout(const DraftLayoutParams& p) {
  DFLASH_CHECK(p.bs >= 0 && p.block >= 1 && p.capacity >= 0, "draft_layout: need bs >= 0, block >= 1, capacity >= 0");
  DFLASH_CHECK(p.kv_indptr && p.kv_indices && p.req_to_token && valid_index(p.req_pool_indices, p.bs > 0),
               "draft_layout: kv_indptr, req_pool_indices, req_to_token and kv_indices are required");
  DFLASH_CHECK(p.req_to_token_stride >= 1 && p.req_to_token_rows >= 1, "draft_layout: empty req_to_token table");
  return 0;
}

#ifdef __CUDACC__
__global__ void draft_layout_kernel(DraftLayoutParams p) {
  const int64_t i = blockIdx.x;
  const int64_t len = draft_layout_len(p, i);
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) draft_layout_row(p, i, t);
}
#endif

}  // namespace dflash
