"""One tiny case of every cuda kernel, for compute-sanitizer (build/device_check.sh).

Forward, backward with atomic dQ, and backward in deterministic mode (the separate dQ
kernel) of a ragged GQA case with causal mask and key lengths, T and S ≡ ±1 modulo the tile
sizes, in bf16 at H=64 and f16 at H=128; each checked against the float32 reference so
that a run that computed nothing cannot pass. Prints one line per configuration.

    compute-sanitizer --tool memcheck python build/sanitizer_case.py
    JAX_FLASH_EMULATE_CUDA=1 python build/sanitizer_case.py   # on the CPU, emulated
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import jax_flash  # noqa: E402
from jax_flash.reference import attention_reference  # noqa: E402


def _grads(impl, q, k, v, cot, kw):
    def loss(q, k, v):
        if impl == "reference":
            out = attention_reference(q, k, v, compute_dtype=jnp.float32, **kw)
        else:
            out = jax_flash.attention(q, k, v, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *g)]


def main() -> int:
    failures = 0
    for dtype, h in ((jnp.bfloat16, 64), (jnp.float16, 128)):
        keys = jax.random.split(jax.random.PRNGKey(h), 4)
        b, t, s, n, kh = 1, 63, 65, 4, 2
        q = (jax.random.normal(keys[0], (b, t, n, h)) + 0.1).astype(dtype)
        k = (jax.random.normal(keys[1], (b, s, kh, h)) - 0.1).astype(dtype)
        v = (jax.random.normal(keys[2], (b, s, kh, h)) + 0.2).astype(dtype)
        cot = jax.random.normal(keys[3], q.shape, jnp.float32)
        kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([s - 2], jnp.int32))
        ref = _grads("reference", q, k, v, cot, kw)
        for mode in ("atomic", "deterministic"):
            if mode == "deterministic":
                os.environ["JAX_FLASH_DETERMINISTIC"] = "1"
            got = _grads("cuda", q, k, v, cot, kw)
            os.environ.pop("JAX_FLASH_DETERMINISTIC", None)
            errs = []
            for a, r in zip(got, ref):
                scale = float(np.max(np.abs(r))) or 1.0
                errs.append(float(np.max(np.abs(a - r))) / scale if np.all(np.isfinite(a)) else np.inf)
            ok = all(e <= 0.03 for e in errs)
            failures += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {jnp.dtype(dtype).name} H={h} {mode}: relative max error "
                + " ".join(f"{name} {e:.2g}" for name, e in zip(("out", "dq", "dk", "dv"), errs)),
                flush=True,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
