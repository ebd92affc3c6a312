r"""Context parallelism: train the flax LM of train_flax_lm.py with its sequence sharded over
8 devices (host devices on a CPU), and check it learns exactly what one device learns.

Every activation is [batch, T/8, ...] on each device: the model runs inside `jax.shard_map`
over a mesh axis "seq", its attention is `jax_flash.ring_attention` (through
`jax_flash.flax.make_attention_fn(axis_name="seq")`), and the loss is summed over the
devices with `lax.psum`. With `--layout=zigzag` (the default) tokens, positions and targets
are reordered by `jax_flash.zigzag` first, so every device does the same causal work.

    python examples/context_parallel.py                        # 8 host devices, zigzag
    python examples/context_parallel.py --layout=contiguous --steps=50
    python examples/context_parallel.py --processes=2          # 2 processes x 4 devices

With `--processes=N` the script starts N copies of itself on this machine (each with
devices/N host devices), joined by `jax.distributed.initialize` (gloo CPU collectives); the
ring then crosses process boundaries as it would across hosts. Process 0 prints; a process
that fails ends the others. On a cluster, run one copy per host yourself with
`--process_id=i --coordinator=HOST:PORT --processes=N`.

Prints the per-device causal block counts of both layouts, the two loss curves (one device,
8 devices) side by side and their max abs difference.
"""

from __future__ import annotations

import os
import pathlib
import sys

# Host devices must be requested before JAX starts (each process gets its share).
_DEVICES, _PROCESSES, _PROCESS_ID = 8, 1, None
for _arg in sys.argv[1:]:
    if _arg.startswith("--devices="):
        _DEVICES = int(_arg.split("=", 1)[1])
    if _arg.startswith("--processes="):
        _PROCESSES = int(_arg.split("=", 1)[1])
    if _arg.startswith("--process_id="):
        _PROCESS_ID = int(_arg.split("=", 1)[1])
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES // max(1, _PROCESSES)}"
).strip()


def _launch_local_processes() -> int:
    """Run this script as `_PROCESSES` processes on this machine (process 0's output is
    shown; the others' only if they fail). The first process to fail ends the others."""
    import socket
    import subprocess
    import tempfile
    import time as _time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for i in range(_PROCESSES):
        log = None if i == 0 else tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed below)
        logs.append(log)
        argv = [sys.executable, *sys.argv, f"--process_id={i}", f"--coordinator=127.0.0.1:{port}"]
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT if log else None))
    while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
        _time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        if log is not None:
            if p.returncode != 0:
                log.seek(0)
                print(f"--- process {i} exited with {p.returncode}:\n{log.read()[-4000:]}", file=sys.stderr)
            log.close()
    return next((p.returncode for p in procs if p.returncode != 0), 0)


if __name__ == "__main__" and _PROCESSES > 1 and _PROCESS_ID is None:
    sys.exit(_launch_local_processes())

import functools  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402
import jax_flash.flax  # noqa: E402
import train_flax_lm as lm  # noqa: E402  (the model, data and flags of the main example)
from jax_flash.parallel.ring import block_counts  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 8, "Devices of the sequence axis (host devices on a CPU).")
flags.DEFINE_enum("layout", "zigzag", ["zigzag", "contiguous"], "Sequence layout of the ring.")
flags.DEFINE_integer("processes", 1, "Processes sharing the devices (started here unless --process_id).")
flags.DEFINE_integer("process_id", None, "This process's index of --processes (set by the launch).")
flags.DEFINE_string("coordinator", None, "HOST:PORT of process 0's coordination service.")
flags.DEFINE_integer("init_timeout", 60, "Seconds to wait for every process to join.")
FLAGS.set_default("steps", 60)
FLAGS.set_default("log_every", 10)


class SeqShardedCharTransformer(lm.CharTransformer):
    """The same model (same parameter tree) on a chunk of the sequence: the positions of
    the chunk's tokens come in explicitly instead of 0..T-1."""

    @nn.compact
    def __call__(self, tokens, positions):
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model))
        x = x + pos[positions]
        for _ in range(self.num_layers):
            x = lm.Block(self.num_heads, self.attention_fn)(x)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def optimizer():
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, FLAGS.learning_rate, max(1, FLAGS.steps // 10), max(2, FLAGS.steps)
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def one_device_loss(model):
    def loss(params, inputs, targets):
        logits = model.apply(params, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


def sequence_parallel_loss(model, mesh):
    """Mean token loss with every [B, T] array sharded over "seq" (in the ring's layout)."""
    seq = P(None, "seq")

    def local(params, inputs, targets, positions):
        logits = model.apply(params, inputs, positions)  # [B, T/P, vocab] on this device
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return lax.psum(nll.sum(), "seq")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq, seq), out_specs=P())

    def loss(params, inputs, targets, positions):
        return sharded(params, inputs, targets, positions) / inputs.size

    return loss


def train(loss_fn, params, batches, prepare, label, place=None):
    tx = optimizer()
    opt_state = tx.init(params)
    jit = jax.jit
    if place is not None:
        # Over the mesh: the step returns params and optimizer state placed as it received
        # them, so that the second step does not compile again.
        opt_state = place(opt_state)
        jit = functools.partial(jax.jit, out_shardings=(*jax.tree.map(lambda x: x.sharding, (params, opt_state)), None))

    @jit
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, t0 = [], None
    for i in range(FLAGS.steps):
        inputs, targets = next(batches)
        params, opt_state, loss = step(params, opt_state, *prepare(inputs, targets))
        losses.append(float(np.asarray(loss.addressable_data(0))))  # replicated
        if i == 0:
            t0 = time.perf_counter()
        if FLAGS.log_every and (i % FLAGS.log_every == 0 or i == FLAGS.steps - 1):
            print(f"[{label}] step {i:4d}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    tokens = (FLAGS.steps - 1) * FLAGS.batch_size * FLAGS.seq_len
    return np.array(losses), tokens / elapsed if elapsed > 0 else float("nan")


def main(argv):
    # absl prints INFO records; JAX's probe of absent backends ("Unable to initialize
    # backend 'tpu'") is one of them and says nothing about this run.
    logging.getLogger("jax").setLevel(logging.WARNING)
    del argv
    if FLAGS.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator,
            num_processes=FLAGS.processes,
            process_id=FLAGS.process_id,
            initialization_timeout=FLAGS.init_timeout,
        )
    p, layout = FLAGS.devices, FLAGS.layout
    if jax.device_count() < p:
        raise SystemExit(f"need {p} devices, have {jax.device_count()}: {jax.devices()}")
    if FLAGS.seq_len % (2 * p):
        raise SystemExit(f"--seq_len must be a multiple of 2 * devices = {2 * p}")
    text = pathlib.Path(FLAGS.text_file).read_text(encoding="utf-8") if FLAGS.text_file else lm.builtin_text()
    data = lm.CharData(text, FLAGS.seq_len)
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices in "
        f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''}"
    )
    print(
        f"model d={FLAGS.d_model}, {FLAGS.num_layers} layers, {FLAGS.num_heads} heads; batch "
        f"{FLAGS.batch_size} x {FLAGS.seq_len}, sequence sharded over {p} devices "
        f"({FLAGS.seq_len // p} tokens each, layout {layout})"
    )
    for name in ("contiguous", "zigzag"):
        print(f"causal blocks per device, {name:10s}: {block_counts(p, layout=name, is_causal=True)}")

    mesh = Mesh(np.array(jax.devices()[:p]), ("seq",))
    flash = jax_flash.flax.make_attention_fn(is_causal=True, implementation=FLAGS.implementation)
    ring = jax_flash.flax.make_attention_fn(
        is_causal=True, implementation=FLAGS.implementation, axis_name="seq", layout=layout
    )
    dims = (data.vocab_size, FLAGS.d_model, FLAGS.num_heads, FLAGS.num_layers, FLAGS.seq_len)
    model_1 = lm.CharTransformer(*dims, flash)
    model_p = SeqShardedCharTransformer(*dims, ring)
    params = model_1.init(jax.random.key(FLAGS.seed), jnp.zeros((FLAGS.batch_size, FLAGS.seq_len), jnp.int32))

    if jax.process_index() == 0:  # the one-device curve: process 0 compares and prints
        losses_1, tps_1 = train(
            one_device_loss(model_1),
            params,
            data.batches(FLAGS.seed, FLAGS.batch_size),
            lambda x, y: (x, y),
            "1 device",
        )

    shard = NamedSharding(mesh, P(None, "seq"))
    order = (lambda x: jax_flash.zigzag(x, p)) if layout == "zigzag" else (lambda x: x)
    positions = np.broadcast_to(np.arange(FLAGS.seq_len), (FLAGS.batch_size, FLAGS.seq_len))

    def global_array(x, sharding):
        # Every process holds the same host data; each places its devices' shards (also
        # when the mesh spans processes, where jax.device_put of host data cannot).
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def prepare(inputs, targets):
        return tuple(global_array(order(jnp.asarray(x, jnp.int32)), shard) for x in (inputs, targets, positions))

    replicated_sharding = NamedSharding(mesh, P())

    def place(tree):
        # Replicated over the mesh (the optimizer's counters start on one device).
        return jax.tree.map(
            lambda x: x if x.sharding == replicated_sharding else global_array(x, replicated_sharding), tree
        )

    replicated = place(params)
    losses_p, tps_p = train(
        sequence_parallel_loss(model_p, mesh),
        replicated,
        data.batches(FLAGS.seed, FLAGS.batch_size),
        prepare,
        f"{p} devices, ring {layout}",
        place,
    )

    if jax.process_index() != 0:
        return
    print("step   1 device   ring")
    for i in range(0, FLAGS.steps, max(1, FLAGS.log_every)):
        print(f"{i:4d}   {losses_1[i]:.5f}    {losses_p[i]:.5f}")
    diff = np.abs(losses_1 - losses_p)
    print(
        f"loss curves, {p} devices in {jax.process_count()} process(es) (ring_attention, {layout}) vs "
        f"1 device: max abs diff "
        f"{diff.max():.2e} (step {int(diff.argmax())}); tokens/s {tps_p:,.0f} vs {tps_1:,.0f}"
    )


if __name__ == "__main__":
    app.run(main)
