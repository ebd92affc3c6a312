"""One forward and one forward+backward call of the cuda kernels at a benchmark size, for a
profiler (Nsight Compute) to attach to.

    ncu --kernel-name regex:'attention_(forward|backward)_plain_kernel' --launch-count 3 \
        --section SpeedOfLight --section WarpStateStats python build/profile_case.py

The case is the benchmark's (docs/gpu-results.md): B=2, N=16, T=S=8192, bf16; the head dim and
the causal mask from the command line (`--head-dim 64 --causal`). Each call runs once after its
compilation, so the launches a profiler sees are, in order: forward; forward, backward (each
routed: the plain kernel, which runs, and the general one beside it, which reads the route and
exits).
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import jax_flash  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    b, n, t, h = 2, 16, args.seq_len, args.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)

    def attend(q, k, v):
        return jax_flash.attention(q, k, v, is_causal=args.causal, implementation="cuda")

    forward = jax.jit(attend)
    backward = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    forward.lower(q, k, v).compile()
    backward.lower(q, k, v).compile()
    jax.block_until_ready(forward(q, k, v))
    jax.block_until_ready(backward(q, k, v))
    print(f"profiled: B={b} N={n} T=S={t} H={h} bf16 causal={args.causal}: forward; forward, backward")


if __name__ == "__main__":
    main()
