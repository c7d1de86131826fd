// Launcher for verify_tree.cuh: C ABI, raw pointers, caller's stream (capturable: no syncs, no allocations).
#include "verify_tree.cuh"

DFLASH_EXPORT_PARAMS_SIZE(verify_tree, dflash::VerifyTreeParams)

extern "C" int dflash_verify_tree(const dflash::VerifyTreeParams* p, cudaStream_t stream) {
  if (int err = dflash::check_verify_tree(*p)) return err;
  DFLASH_CHECK(p->bs < (int64_t(1) << 31), "verify_tree: bs too large for the grid");
  if (p->bs == 0) return 0;
  if (p->target_probs != nullptr) {
    constexpr int T = dflash::kSamplingThreads;
    dflash::verify_tree_kernel<true, T><<<unsigned(p->bs), T, 0, stream>>>(*p);
  } else {
    constexpr int T = dflash::kGreedyThreads;
    dflash::verify_tree_kernel<false, T><<<unsigned(p->bs), T, 0, stream>>>(*p);
  }
  return dflash::launch_status("verify_tree");
}
