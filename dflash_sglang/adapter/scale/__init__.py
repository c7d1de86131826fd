"""Scale-out: what a step needs when the server spans ranks or servers.

`tp` (tensor parallelism: the draft vocabulary merged over ranks), `dp_attention` (every attention-DP group's rows
agreed each step), `disagg` (PD disaggregation: our draft pool registered with the KV transfer engine), `retraction`
(a PD decode server's retracted requests: their draft rows backed up to host and restored with the target's KV),
`hicache` (HiCache: the draft pool offloaded to host with the target's). Called by the step through the names it
imports; imports draft/ and the adapter's settings and versions.
"""
