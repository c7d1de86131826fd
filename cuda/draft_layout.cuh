// draft_kv_indices: the key rows of one drafter pass over the paged draft pool (page size 1), from the slot rows
// (req_to_token) or from a draft window's ring of rows per request slot.
// Reference: dflash_sglang/core/step/block.py draft_kv_indices. One CUDA block per request, its threads striding over
// the request's rows. kv_indptr and seq_lens are read on the device, so a CUDA graph of a fixed batch size can capture
// the launch while the host refills kv_indptr before each replay.
#pragma once

#include "common.cuh"

namespace dflash {

struct DraftLayoutParams {
  const int32_t* kv_indptr;     // [bs+1]: request i's keys are rows kv_indptr[i] .. kv_indptr[i+1]-1 of kv_indices
  IndexView req_pool_indices;   // [bs]: row of req_to_token (and owner of the block scratch) per request
  const int32_t* req_to_token;  // [R, W] request -> KV slot table (unused with a ring)
  int64_t req_to_token_stride;  // W
  int64_t req_to_token_rows;    // R
  int64_t scratch_base;         // request-pool slot r's block rows are scratch_base + r*block .. + block-1
  int64_t block;
  int64_t bs;
  int64_t capacity;             // kv_indices length; rows past kv_indptr[bs] are left as they are
  int32_t* kv_indices;          // [capacity]
  IndexView seq_lens;           // [bs] committed lengths (a draft window's last positions), or null: from position 0
  int64_t ring;                 // R > 0: position p of request slot r at row r*R + p % R (needs seq_lens); 0: the table
};

// Row t of request i: the row of context position pos = first + t for t < ctx_len = kv_len - block (first = seq_len -
// ctx_len with seq_lens, the window's last ctx_len positions; else 0), else the request's block scratch row. The row of
// pos: its slot in the table, or its ring row. A context row outside the table (or before position 0) gets -1, as in
// the reference (the worker never builds such a layout).
DFLASH_HD void draft_layout_row(const DraftLayoutParams& p, int64_t i, int64_t t) {
  const int64_t start = p.kv_indptr[i], ctx_len = p.kv_indptr[i + 1] - start - p.block;
  const int64_t r = p.req_pool_indices[i];
  int64_t value;
  if (t < ctx_len) {
    const int64_t pos = (p.seq_lens.present() ? p.seq_lens[i] - ctx_len : 0) + t;
    if (p.ring > 0) {
      value = r >= 0 && pos >= 0 ? r * p.ring + pos % p.ring : -1;
    } else {
      const bool inside = r >= 0 && r < p.req_to_token_rows && pos >= 0 && pos < p.req_to_token_stride;
      value = inside ? p.req_to_token[r * p.req_to_token_stride + pos] : -1;
    }
  } else {
    value = p.scratch_base + r * p.block + (t - ctx_len);
  }
  if (start + t < p.capacity) p.kv_indices[start + t] = static_cast<int32_t>(value);
}

DFLASH_HD int64_t draft_layout_len(const DraftLayoutParams& p, int64_t i) { return p.kv_indptr[i + 1] - p.kv_indptr[i]; }

inline int check_draft_layout(const DraftLayoutParams& p) {
  DFLASH_CHECK(p.bs >= 0 && p.block >= 1 && p.capacity >= 0 && p.ring >= 0,
               "draft_layout: need bs >= 0, block >= 1, capacity >= 0, ring >= 0");
  DFLASH_CHECK(p.kv_indptr && p.kv_indices && valid_index(p.req_pool_indices, p.bs > 0),
               "draft_layout: kv_indptr, req_pool_indices and kv_indices are required");
  DFLASH_CHECK(valid_index(p.seq_lens, p.ring > 0),
               "draft_layout: seq_lens must be int32 or int64 (required with a ring)");
  if (p.ring == 0)
    DFLASH_CHECK(p.req_to_token && p.req_to_token_stride >= 1 && p.req_to_token_rows >= 1,
                 "draft_layout: a non-empty req_to_token table is required without a ring");
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
