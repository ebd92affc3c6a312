r"""Generate text from the small flax LM with a paged KV cache, one compiled step under jit.

Trains the character-level transformer of examples/train_flax_lm.py briefly (the same model
definition, data and flags), then decodes a batch of prompts greedily two ways:

* full recomputation: every new token reruns the model over the whole prefix (no cache);
* a paged KV cache: each layer's K/V live in pages `[num_pages, page_size, heads, head_dim]`
  handed out to the sequences in shuffled order (`page_table`), one token per step:
  `jax_flash.paged_cache_write` appends the step's K/V in place and
  `jax_flash.paged_attention` attends over the cache through the table. The step is one
  `jax.jit` function with the cache donated, so it is updated in place and compiled once.

It checks that both give the same tokens and prints tokens/s for each.

    python examples/generate_flax_lm.py
    python examples/generate_flax_lm.py --steps=300 --gen_tokens=100 --page_size=16
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_flash
import jax_flash.flax
import train_flax_lm as lm  # the model, the data and the training flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("gen_tokens", 48, "Tokens to generate per prompt (prompt + these <= seq_len).")
flags.DEFINE_integer("page_size", 16, "Positions per page of the KV cache.")
PROMPTS = ("Beautiful is ", "Simple is", "Errors should ", "Now is better")


# ----------------------------------------------------------------------------- the cached step


def layer_params(params, name):
    return {"params": params["params"][name]}


def decode_step(model: lm.CharTransformer, params, cache, table, tokens, position):
    """Logits [B, V] of the next token after `tokens` [B] at `position` (the same for every
    row: the prompts advance in lockstep), and the cache with this step's K/V appended.

    The trained CharTransformer's own layers (flax modules applied to its parameters), with
    the attention of MultiHeadDotProductAttention replaced by a write to the paged cache and
    jax_flash.paged_attention over it."""
    heads, d = model.num_heads, model.d_model
    lengths = jnp.full(tokens.shape, position, jnp.int32)  # positions already in the cache
    p = params["params"]
    x = nn.Embed(model.vocab_size, d).apply({"params": p["Embed_0"]}, tokens)[:, None]
    x = x + p["pos_embedding"][position][None, None]
    new_cache = []
    for i, (key_pages, value_pages) in enumerate(cache):
        blk = p[f"Block_{i}"]
        mha = blk["MultiHeadDotProductAttention_0"]
        h = nn.LayerNorm().apply({"params": blk["LayerNorm_0"]}, x)
        proj = lambda name, mha=mha, h=h: nn.DenseGeneral((heads, d // heads)).apply({"params": mha[name]}, h)
        q, k, v = proj("query"), proj("key"), proj("value")  # [B, 1, heads, head_dim]
        key_pages, value_pages = jax_flash.paged_cache_write(key_pages, value_pages, table, lengths, k, v)
        new_cache.append((key_pages, value_pages))
        a = jax_flash.paged_attention(q, key_pages, value_pages, table, lengths + 1)
        x = x + nn.DenseGeneral(d, axis=(-2, -1)).apply({"params": mha["out"]}, a)
        h = nn.LayerNorm().apply({"params": blk["LayerNorm_1"]}, x)
        h = nn.gelu(nn.Dense(4 * d).apply({"params": blk["Dense_0"]}, h))
        x = x + nn.Dense(d).apply({"params": blk["Dense_1"]}, h)
    logits = nn.Dense(model.vocab_size).apply(
        {"params": p["Dense_0"]}, nn.LayerNorm().apply({"params": p["LayerNorm_0"]}, x)
    )
    return logits[:, 0], tuple(new_cache)


def empty_cache(model, batch: int, max_len: int, page_size: int, seed: int):
    """Per layer (key_pages, value_pages) and a page table: each sequence gets
    ceil(max_len / page_size) pages of one shared pool, in shuffled order."""
    max_pages = -(-max_len // page_size)
    num_pages = batch * max_pages + 1  # one spare page nobody uses
    table = np.random.default_rng(seed).permutation(num_pages)[: batch * max_pages]
    shape = (num_pages, page_size, model.num_heads, model.d_model // model.num_heads)
    cache = tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(model.num_layers))
    return cache, jnp.asarray(table.reshape(batch, max_pages), jnp.int32)


def generate_cached(step, model, params, prompts: np.ndarray, prompt_len: int, n: int):
    """Greedy tokens [B, n] after `prompts` [B, prompt_len] with the jitted `step` (one call
    per position, the cache donated to it and updated in place)."""
    cache, table = empty_cache(model, prompts.shape[0], prompt_len + n, FLAGS.page_size, FLAGS.seed)
    out = []
    tokens = jnp.asarray(prompts[:, 0])
    for position in range(prompt_len + n - 1):
        logits, cache = step(params, cache, table, tokens, jnp.int32(position))
        if position + 1 < prompt_len:
            tokens = jnp.asarray(prompts[:, position + 1])  # still reading the prompt
        else:
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out.append(tokens)
    return np.asarray(jnp.stack(out, axis=1))


def generate_full(logits_at, params, prompts: np.ndarray, prompt_len: int, n: int, seq_len: int):
    """The same greedy tokens by rerunning the model over the whole prefix for each token."""
    seq = np.zeros((prompts.shape[0], seq_len), np.int32)
    seq[:, :prompt_len] = prompts
    for i in range(prompt_len, prompt_len + n):
        seq[:, i] = np.asarray(jnp.argmax(logits_at(params, jnp.asarray(seq), i - 1), axis=-1))
    return seq[:, prompt_len : prompt_len + n]


def compilations(jitted) -> str:
    size = getattr(jitted, "_cache_size", None)  # not public API: report it where it exists
    return str(size()) if size is not None else "?"


def timed(fn, *args):
    fn(*args)  # the first run compiles
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main(argv):
    del argv
    logging.getLogger("jax").setLevel(logging.WARNING)  # not absl's INFO about absent backends
    text = pathlib.Path(FLAGS.text_file).read_text(encoding="utf-8") if FLAGS.text_file else lm.builtin_text()
    data = lm.CharData(text, FLAGS.seq_len)
    flash_fn = jax_flash.flax.make_attention_fn(implementation=FLAGS.implementation, is_causal=True)
    _, _, model, params = lm.train(data, flash_fn, "train")

    prompt_len = min(len(p) for p in PROMPTS)
    n = min(FLAGS.gen_tokens, FLAGS.seq_len - prompt_len)
    prompts = np.array([[data.index.get(c, 0) for c in p[:prompt_len]] for p in PROMPTS], np.int32)
    b = len(PROMPTS)
    head_dim = FLAGS.d_model // FLAGS.num_heads
    q = jnp.zeros((b, 1, FLAGS.num_heads, head_dim))
    cache, table = empty_cache(model, b, prompt_len + n, FLAGS.page_size, FLAGS.seed)
    print(jax_flash.explain_paged(q, *cache[0], table, jnp.full((b,), prompt_len, jnp.int32)))

    step = jax.jit(functools.partial(decode_step, model), donate_argnums=(1,))
    logits_at = jax.jit(lambda params, toks, i: model.apply(params, toks)[:, i])
    cached, t_cached = timed(generate_cached, step, model, params, prompts, prompt_len, n)
    full, t_full = timed(generate_full, logits_at, params, prompts, prompt_len, n, FLAGS.seq_len)
    print(
        f"paged KV cache: {b * n / t_cached:,.0f} tokens/s ({b} prompts x {n} tokens, "
        f"page_size {FLAGS.page_size}, one compiled step ({compilations(step)} compilation), "
        "cache donated)"
    )
    print(f"full recomputation: {b * n / t_full:,.0f} tokens/s")
    for p, row in zip(PROMPTS, cached):
        print(f"  {p[:prompt_len]!r} -> {data.decode(row)!r}")
    same = np.array_equal(cached, full)
    print(f"tokens equal to greedy generation by full recomputation: {same}")
    if not same:
        raise SystemExit("the paged KV cache generated different tokens")


if __name__ == "__main__":
    app.run(main)
