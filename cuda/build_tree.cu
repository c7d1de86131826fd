// Launcher for build_tree.cuh: C ABI, raw pointers, caller's stream (capturable: no syncs, no allocations).
#include "build_tree.cuh"

DFLASH_EXPORT_PARAMS_SIZE(build_tree, dflash::BuildTreeParams)

extern "C" int dflash_build_tree(const dflash::BuildTreeParams* p, cudaStream_t stream) {
  if (int err = dflash::check_build_tree(*p)) return err;
  const int64_t smem = dflash::tree_scratch_bytes(p->n, p->depth, p->k);
  DFLASH_CHECK(smem <= 48 * 1024, "build_tree: N=%lld D=%lld K=%lld needs %lld B of shared memory (> 48 KiB)",
               (long long)p->n, (long long)p->depth, (long long)p->k, (long long)smem);
  DFLASH_CHECK(p->bs < (int64_t(1) << 31), "build_tree: bs too large for the grid");
  if (p->bs == 0) return 0;
  dflash::build_tree_kernel<<<unsigned(p->bs), 32, size_t(smem), stream>>>(*p);
  return dflash::launch_status("build_tree");
}
