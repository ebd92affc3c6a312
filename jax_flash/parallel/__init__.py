"""Many devices on JAX's own SPMD machinery.

* `partitioning`: `custom_partitioning` rules (Shardy) for the compiled calls, so that
  batch-, head- and query-sharded inputs run on their local shards under plain `jax.jit`.
* `ring`: context parallelism, `ring_attention` inside `shard_map` (K/V chunks rotate with
  `lax.ppermute`, partial results merge by lse), and the zigzag layout helpers.
* `ulysses`: all-to-all sequence parallelism, `ulysses_attention` (sequence -> heads, one
  local `attention`, heads -> sequence), and `hybrid_attention` (all-to-all over one mesh
  axis, the ring over another).
"""
