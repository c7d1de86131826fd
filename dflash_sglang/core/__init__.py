"""The algorithm as plain PyTorch: the executable spec every faster path is tested against.

Never imports sglang. Modules: config (checkpoint config), drafter (the DFlash module),
checkpoint (safetensors load/save), block (block inputs), accept (greedy + rejection sampling),
tree (draft trees), features (target feature capture), reference (the reference decoder),
token_map (reduced draft vocabulary).
"""
