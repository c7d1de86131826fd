"""One prepared training window on a lent GPU (docs/gpu_train.md): the real SmolLM2-135M-Instruct target carried in,
its responses to train-split prompts regenerated on the device, the shipped drafter trained on them, the checkpoint
brought back, all of the last call within one budget counted from the call's start.

Why several calls: a call carries at most 64 MiB, the working tree (~19 MiB) included, and the Q4_1 GGUF is 94 MiB
(86 MiB as xz, lossless; its 4-bit codes hold 3.86 bits of entropy each, so no lossless coding gets it into one call).
`prepare` (here) cuts the stream into one folder per call, each with the manifest (the sha256 of every part and of the
GGUF); every call but the last only `receive`s its part into a store outside the tree, which a warm machine keeps
(~30 s between calls); the last call receives its own, joins them, checks the GGUF's hash and trains. A returned file
is at most 16 MiB and the bf16 drafter is 17.5 MB, so it comes back as parts of a tar, their sha256 in train.json;
`reassemble` (here) joins and checks them. Nothing on the device path calls git or a registry.

  python -m dflash_sglang.bench.gpu.train prepare                  # here: the call folders, the limits, the calls
  python -m dflash_sglang.bench.gpu.train receive                  # device: every call but the last
  python -m dflash_sglang.bench.gpu.train run --budget-s 540       # device: the last call
  python -m dflash_sglang.bench.gpu.train reassemble DIR --to DEST # here: the returned parts -> a drafter directory
  python -m dflash_sglang.bench.gpu.train rehearse                 # CPU: all of it at tiny size (CI)

The package, one idea a module: `carry` (the device's limits; the parts, their hashes, receiving, joining, the
drafter's tar and its reassembly), `plan` (the sizes per device, where files lie, `prepare`), `window` (the budget,
the phases, their verdicts, the report), `rehearsal` (the CPU run of all of it) and `__main__` (the command line).
Importing the package imports none of them.
"""
