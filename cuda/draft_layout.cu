// Launcher for draft_layout.cuh: C ABI, raw pointers, caller's stream (capturable: no syncs, no allocations).
#include "draft_layout.cuh"

DFLASH_EXPORT_PARAMS_SIZE(draft_layout, dflash::DraftLayoutParams)

extern "C" int dflash_draft_layout(const dflash::DraftLayoutParams* p, cudaStream_t stream) {
  if (int err = dflash::check_draft_layout(*p)) return err;
  if (p->bs == 0) return 0;
  dflash::draft_layout_kernel<<<int(p->bs), 256, 0, stream>>>(*p);
  return dflash::launch_status("draft_layout");
}
