"""Timed CPU `sgl.Engine` passes and the words for their ratios: what the demo measures with and the Engine
benchmarks (`dflash_sglang/bench/`) build on. Imports nothing of bench/."""
