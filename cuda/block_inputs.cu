// Launcher for block_inputs.cuh: C ABI, raw pointers, caller's stream (capturable: no syncs, no allocations).
#include "block_inputs.cuh"

DFLASH_EXPORT_PARAMS_SIZE(block_inputs, dflash::BlockInputsParams)

extern "C" int dflash_block_inputs(const dflash::BlockInputsParams* p, cudaStream_t stream) {
  if (int err = dflash::check_block_inputs(*p)) return err;
  const int64_t total = p->bs * p->n;
  if (total == 0) return 0;
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  dflash::block_inputs_kernel<<<int(blocks < 4096 ? blocks : 4096), kThreads, 0, stream>>>(*p);
  return dflash::launch_status("block_inputs");
}
