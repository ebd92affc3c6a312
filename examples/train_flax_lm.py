r"""Train a small character-level causal transformer (flax linen) with jax_flash attention.

The text ships with Python itself (the Zen of Python and the interpreter's LICENSE.txt, or
the source of a stdlib module), so nothing is downloaded. Attention runs in
`jax_flash.attention` through `flax.linen.MultiHeadDotProductAttention(attention_fn=...)`,
the whole train step under `jax.jit`.

    python examples/train_flax_lm.py
    python examples/train_flax_lm.py --compare            # also train with jax.nn, same seed
    python examples/train_flax_lm.py --implementation=xla --steps=500

Prints which jax_flash implementation ran for the model's shapes, the falling loss,
tokens/s and, with --compare, how far the loss curve is from jax.nn.dot_product_attention's.
"""

from __future__ import annotations

import ast
import codecs
import importlib.util
import logging
import os
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from tqdm import tqdm

import jax_flash
import jax_flash.flax

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 250, "Training steps.")
flags.DEFINE_integer("batch_size", 16, "Sequences per batch.")
flags.DEFINE_integer("seq_len", 128, "Characters per sequence.")
flags.DEFINE_integer("d_model", 96, "Model width.")
flags.DEFINE_integer("num_heads", 4, "Attention heads.")
flags.DEFINE_integer("num_layers", 2, "Transformer blocks.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of the parameters and of the batches.")
flags.DEFINE_enum(
    "implementation",
    None,
    ["cuda", "pallas", "cpu", "xla"],
    "jax_flash implementation (default: the best one available).",
)
flags.DEFINE_bool(
    "compare",
    False,
    "Also train with jax.nn.dot_product_attention from the same seed and "
    "report the max abs difference of the two loss curves.",
)
flags.DEFINE_integer("log_every", 25, "Print the loss every this many steps.")
flags.DEFINE_integer("sample_chars", 120, "Characters to sample after training (0: none).")
flags.DEFINE_string("text_file", None, "Train on this text file instead of the built-in text.")


# ----------------------------------------------------------------------------- data


def zen_of_python() -> str:
    """The Zen of Python, read from the `this` module's source (importing it would print)."""
    source = pathlib.Path(importlib.util.find_spec("this").origin).read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    return ""


def builtin_text() -> str:
    """Text shipped with the interpreter: the Zen plus LICENSE.txt (or textwrap's source)."""
    parts = [zen_of_python()]
    license_txt = os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")
    if os.path.exists(license_txt):
        parts.append(pathlib.Path(license_txt).read_text(encoding="utf-8", errors="replace"))
    else:
        parts.append(pathlib.Path(importlib.util.find_spec("textwrap").origin).read_text(encoding="utf-8"))
    return "\n\n".join(parts)


class CharData:
    """Character vocabulary and random training windows."""

    def __init__(self, text: str, seq_len: int):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.ids = np.array([self.index[c] for c in text], np.int32)
        self.seq_len = seq_len
        if len(self.ids) <= seq_len + 1:
            raise ValueError(f"the text has {len(self.ids)} characters, need > {seq_len + 1}")

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batches(self, seed: int, batch_size: int):
        rng = np.random.default_rng(seed)
        while True:
            starts = rng.integers(0, len(self.ids) - self.seq_len - 1, batch_size)
            window = np.stack([self.ids[s : s + self.seq_len + 1] for s in starts])
            yield window[:, :-1], window[:, 1:]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    num_heads: int
    attention_fn: callable

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, attention_fn=self.attention_fn)(h)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * d)(h)
        h = nn.gelu(h)
        return x + nn.Dense(d)(h)


class CharTransformer(nn.Module):
    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    max_len: int
    attention_fn: callable

    @nn.compact
    def __call__(self, tokens):
        t = tokens.shape[-1]
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model))
        x = x + pos[:t]
        for _ in range(self.num_layers):
            x = Block(self.num_heads, self.attention_fn)(x)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def jax_nn_causal_attention_fn(query, key, value, bias=None, mask=None, dtype=None, **unused):
    """The same causal attention by jax.nn.dot_product_attention (for --compare)."""
    del unused
    if mask is not None:
        mask = mask != 0
    return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=True)


# ----------------------------------------------------------------------------- training


def train(data: CharData, attention_fn, label: str):
    """Trains from FLAGS.seed; returns (losses per step, tokens/s, model, params)."""
    model = CharTransformer(
        data.vocab_size, FLAGS.d_model, FLAGS.num_heads, FLAGS.num_layers, FLAGS.seq_len, attention_fn
    )
    tokens0 = jnp.zeros((FLAGS.batch_size, FLAGS.seq_len), jnp.int32)
    params = model.init(jax.random.key(FLAGS.seed), tokens0)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, FLAGS.learning_rate, max(1, FLAGS.steps // 10), max(2, FLAGS.steps)
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        def loss_fn(params):
            logits = model.apply(params, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    batches = data.batches(FLAGS.seed, FLAGS.batch_size)
    t_start = None
    bar = tqdm(range(FLAGS.steps), desc=label, unit="step", dynamic_ncols=True)
    for i in bar:
        inputs, targets = next(batches)
        params, opt_state, loss = step(params, opt_state, inputs, targets)
        loss = float(loss)  # waits for the step
        losses.append(loss)
        if i == 0:
            t_start = time.perf_counter()  # the first step compiled: time the others
        bar.set_postfix(loss=f"{loss:.3f}")
        if FLAGS.log_every and (i % FLAGS.log_every == 0 or i == FLAGS.steps - 1):
            tqdm.write(f"[{label}] step {i:4d}  loss {loss:.4f}")
    bar.close()
    elapsed = time.perf_counter() - t_start if t_start is not None else 0.0
    tokens = (FLAGS.steps - 1) * FLAGS.batch_size * FLAGS.seq_len
    tokens_per_s = tokens / elapsed if elapsed > 0 else float("nan")
    return np.array(losses), tokens_per_s, model, params


def sample(model, params, data: CharData, prompt: str, n: int, seed: int) -> str:
    """Autoregressive sampling (temperature 0.8) over a fixed window, one jit."""
    ids = [data.index.get(c, 0) for c in prompt][-FLAGS.seq_len :]
    logits_at = jax.jit(lambda p, toks, i: model.apply(p, toks[None])[0, i])
    key = jax.random.key(seed)
    out = []
    for _ in range(n):
        window = ids[-FLAGS.seq_len :]
        toks = jnp.array(window + [0] * (FLAGS.seq_len - len(window)), jnp.int32)
        key, sub = jax.random.split(key)
        nxt = int(jax.random.categorical(sub, logits_at(params, toks, len(window) - 1) / 0.8))
        ids.append(nxt)
        out.append(nxt)
    return data.decode(out)


def main(argv):
    # absl prints INFO records; JAX's probe of absent backends ("Unable to initialize
    # backend 'tpu'") is one of them and says nothing about this run.
    logging.getLogger("jax").setLevel(logging.WARNING)
    del argv
    text = pathlib.Path(FLAGS.text_file).read_text(encoding="utf-8") if FLAGS.text_file else builtin_text()
    data = CharData(text, FLAGS.seq_len)
    head_dim = FLAGS.d_model // FLAGS.num_heads
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, jax_flash {jax_flash.__version__}")
    print(
        f"text: {len(data.ids)} characters, vocabulary {data.vocab_size}; model d={FLAGS.d_model}, "
        f"{FLAGS.num_layers} layers, {FLAGS.num_heads} heads of {head_dim}, "
        f"batch {FLAGS.batch_size} x {FLAGS.seq_len}"
    )

    # Which implementation jax_flash runs for exactly the model's attention shapes.
    q = jnp.zeros((FLAGS.batch_size, FLAGS.seq_len, FLAGS.num_heads, head_dim), jnp.float32)
    explanation = jax_flash.explain(q, q, q, is_causal=True, implementation=FLAGS.implementation)
    print(explanation)
    print(f"jax_flash implementation: {explanation.selected}")

    flash_fn = jax_flash.flax.make_attention_fn(implementation=FLAGS.implementation, is_causal=True)
    losses, tps, model, params = train(data, flash_fn, f"jax_flash[{explanation.selected}]")
    k = max(1, min(10, len(losses) // 5))
    print(
        f"jax_flash[{explanation.selected}]: loss {losses[:k].mean():.4f} (first {k} steps) -> "
        f"{losses[-k:].mean():.4f} (last {k}), {tps:,.0f} tokens/s"
    )

    if FLAGS.compare:
        ref_losses, ref_tps, _, _ = train(data, jax_nn_causal_attention_fn, "jax.nn")
        diff = np.abs(losses - ref_losses)
        print(f"jax.nn: loss {ref_losses[:k].mean():.4f} -> {ref_losses[-k:].mean():.4f}, {ref_tps:,.0f} tokens/s")
        print(
            f"loss curves, jax_flash[{explanation.selected}] vs jax.nn.dot_product_attention: "
            f"max abs diff {diff.max():.2e} (step {int(diff.argmax())}), "
            f"final {diff[-1]:.2e}; speed ratio {tps / ref_tps:.2f}x"
        )

    if FLAGS.sample_chars:
        prompt = "Beautiful is "
        print(f"sample: {prompt!r} -> {sample(model, params, data, prompt, FLAGS.sample_chars, FLAGS.seed)!r}")


if __name__ == "__main__":
    app.run(main)
