"""The algorithm as plain PyTorch: the executable spec every faster path is tested against.

Never imports sglang. Three rooms: draft/ (the drafter and its checkpoint), step/ (a decode step's pieces: inputs,
trees, acceptance), shape/ (choosing the verify shape); `speculate` (the decode step, shared by the reference and the
worker) and `reference` (the reference decoder) read all three. draft/ and shape/ import step/; step/ imports neither.
"""
