r"""Train a small character-level causal transformer in haiku with jax_flash attention.

`jax_flash.haiku.MultiHeadAttention` is `haiku.MultiHeadAttention` (same constructor, same
parameters) with the attention computed by `jax_flash.attention`. The text ships with
Python (the interpreter's LICENSE.txt, or a stdlib module's source): no downloads.

    python examples/train_haiku_lm.py
    python examples/train_haiku_lm.py --implementation=xla --steps=300
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from tqdm import tqdm

import jax_flash
import jax_flash.haiku

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 200, "Training steps.")
flags.DEFINE_integer("batch_size", 16, "Sequences per batch.")
flags.DEFINE_integer("seq_len", 128, "Characters per sequence.")
flags.DEFINE_integer("d_model", 64, "Model width.")
flags.DEFINE_integer("num_heads", 4, "Attention heads.")
flags.DEFINE_integer("num_layers", 2, "Transformer blocks.")
flags.DEFINE_float("learning_rate", 3e-3, "AdamW learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of the parameters and of the batches.")
flags.DEFINE_enum(
    "implementation",
    None,
    ["cuda", "pallas", "cpu", "xla"],
    "jax_flash implementation (default: the best one available).",
)
flags.DEFINE_integer("log_every", 25, "Print the loss every this many steps.")


def load_text() -> str:
    license_txt = os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")
    path = license_txt if os.path.exists(license_txt) else importlib.util.find_spec("textwrap").origin
    return open(path, encoding="utf-8", errors="replace").read()


def model_fn(tokens, vocab_size: int):
    t = tokens.shape[-1]
    head_dim = FLAGS.d_model // FLAGS.num_heads
    init = hk.initializers.VarianceScaling(1.0)
    x = hk.Embed(vocab_size, FLAGS.d_model)(tokens)
    x = (
        x
        + hk.get_parameter("pos_embedding", [FLAGS.seq_len, FLAGS.d_model], init=hk.initializers.TruncatedNormal(0.02))[
            :t
        ]
    )
    for _ in range(FLAGS.num_layers):
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
        x = x + jax_flash.haiku.MultiHeadAttention(
            num_heads=FLAGS.num_heads,
            key_size=head_dim,
            w_init=init,
            is_causal=True,
            implementation=FLAGS.implementation,
        )(h, h, h)
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
        x = x + hk.nets.MLP([4 * FLAGS.d_model, FLAGS.d_model], activation=jax.nn.gelu)(h)
    x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
    return hk.Linear(vocab_size)(x)


def main(argv):
    # absl prints INFO records; JAX's probe of absent backends ("Unable to initialize
    # backend 'tpu'") is one of them and says nothing about this run.
    logging.getLogger("jax").setLevel(logging.WARNING)
    del argv
    text = load_text()
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], np.int32)
    vocab = len(chars)
    head_dim = FLAGS.d_model // FLAGS.num_heads
    q = jnp.zeros((FLAGS.batch_size, FLAGS.seq_len, FLAGS.num_heads, head_dim), jnp.float32)
    selected = jax_flash.explain(q, q, q, is_causal=True, implementation=FLAGS.implementation).selected
    print(f"text: {len(ids)} characters, vocabulary {vocab}; jax_flash implementation: {selected}")

    model = hk.without_apply_rng(hk.transform(lambda toks: model_fn(toks, vocab)))
    params = model.init(jax.random.key(FLAGS.seed), jnp.zeros((1, FLAGS.seq_len), jnp.int32))
    tx = optax.adamw(FLAGS.learning_rate, weight_decay=0.01)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        def loss_fn(params):
            logits = model.apply(params, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(FLAGS.seed)
    losses, t0 = [], None
    for i in (bar := tqdm(range(FLAGS.steps), desc=f"haiku+jax_flash[{selected}]")):
        starts = rng.integers(0, len(ids) - FLAGS.seq_len - 1, FLAGS.batch_size)
        window = np.stack([ids[s : s + FLAGS.seq_len + 1] for s in starts])
        params, opt_state, loss = step(params, opt_state, window[:, :-1], window[:, 1:])
        losses.append(float(loss))
        if i == 0:
            t0 = time.perf_counter()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if FLAGS.log_every and (i % FLAGS.log_every == 0 or i == FLAGS.steps - 1):
            tqdm.write(f"step {i:4d}  loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - t0
    k = max(1, min(10, len(losses) // 5))
    tokens_per_s = (FLAGS.steps - 1) * FLAGS.batch_size * FLAGS.seq_len / max(elapsed, 1e-9)
    print(
        f"jax_flash[{selected}]: loss {np.mean(losses[:k]):.4f} -> {np.mean(losses[-k:]):.4f}, "
        f"{tokens_per_s:,.0f} tokens/s"
    )


if __name__ == "__main__":
    app.run(main)
