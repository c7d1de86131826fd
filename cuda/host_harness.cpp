// CPU build of the kernels' per-request logic, for tests without a GPU (tests/test_tree.py builds it with g++).
// Same params structs, checks and per-request functions as the CUDA launchers; what it cannot cover is the
// warp argmax of build_tree and the certified parallel pass of the sampler (tests/test_ops_gpu.py does).
#include <vector>

#include "block_inputs.cuh"
#include "build_tree.cuh"
#include "draft_layout.cuh"
#include "common.cu"
#include "verify_tree.cuh"

DFLASH_EXPORT_PARAMS_SIZE(block_inputs, dflash::BlockInputsParams)
DFLASH_EXPORT_PARAMS_SIZE(build_tree, dflash::BuildTreeParams)
DFLASH_EXPORT_PARAMS_SIZE(draft_layout, dflash::DraftLayoutParams)
DFLASH_EXPORT_PARAMS_SIZE(verify_tree, dflash::VerifyTreeParams)

extern "C" int dflash_host_block_inputs(const dflash::BlockInputsParams* p) {
  if (int err = dflash::check_block_inputs(*p)) return err;
  for (int64_t idx = 0; idx < p->bs * p->n; ++idx) dflash::block_inputs_row(*p, idx);
  return 0;
}

extern "C" int dflash_host_draft_layout(const dflash::DraftLayoutParams* p) {
  if (int err = dflash::check_draft_layout(*p)) return err;
  for (int64_t i = 0; i < p->bs; ++i)
    for (int64_t t = 0; t < dflash::draft_layout_len(*p, i); ++t) dflash::draft_layout_row(*p, i, t);
  return 0;
}

extern "C" int dflash_host_build_tree(const dflash::BuildTreeParams* p) {
  if (int err = dflash::check_build_tree(*p)) return err;
  std::vector<int64_t> buffer((dflash::tree_scratch_bytes(p->n, p->depth, p->k) + 7) / 8);
  const dflash::TreeScratch s =
      dflash::carve_tree_scratch(reinterpret_cast<unsigned char*>(buffer.data()), p->n, p->depth, p->k);
  for (int64_t b = 0; b < p->bs; ++b) dflash::build_tree_request(*p, b, s, dflash::SerialGroup{});
  return 0;
}

extern "C" int dflash_host_verify_tree(const dflash::VerifyTreeParams* p) {
  if (int err = dflash::check_verify_tree(*p)) return err;
  std::vector<dflash::VerifyScratch> scratch(1);
  dflash::VerifyScratch& s = scratch[0];
  const bool sampling = p->target_probs != nullptr;
  for (int64_t b = 0; b < p->bs; ++b) {
    int64_t bonus;
    if (sampling) {
      dflash::load_request<true>(*p, b, s, 0, 1);
      dflash::walk_tree<true>(*p, s);
      const float* w = p->target_probs + (b * p->n + s.path[s.len]) * p->vocab;
      bonus = dflash::sample_serial(w, p->vocab, s.rejected, s.n_rejected, p->resample_u[b]);
      if (bonus < 0) bonus = dflash::sample_serial(w, p->vocab, s.rejected, 0, p->resample_u[b]);
      if (bonus < 0) bonus = p->vocab - 1;
    } else {
      dflash::load_request<false>(*p, b, s, 0, 1);
      dflash::walk_tree<false>(*p, s);
      bonus = s.want[s.path[s.len]];
    }
    dflash::write_verify_outputs(*p, b, s, bonus, 0, 1);
  }
  return 0;
}
