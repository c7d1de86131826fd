"""The drafter inside SGLang: core's weights over a paged draft KV pool.

`model` (the drafter: commit target features as context K/V, one block pass), `pool` (the draft KV pool),
`context_rows` (which pool rows hold a request's context: one per target KV slot, or a draft window's rings),
`attention` (its paged attention: FlashInfer on CUDA, torch on CPU), `graphs` and `selector_graph` (the draft pass
and commit, and a DFlash2 selector, as CUDA graphs), `memory` (what the pool costs, told to SGLang's KV sizing).
Built when the worker starts, run every step; imports core and ops only (the pool's sizing hook reads SGLang's
runtime context).
"""
