"""`--tune-pallas`: the Pallas block sizes tuned before the attention table is measured,
with `jax_flash.pallas._tune.tune(...)` (which writes the tile table, jax_flash/pallas/table.json)."""

from __future__ import annotations


def tune_pallas(args) -> None:
    try:
        from jax_flash.pallas._tune import tune
    except ImportError as e:
        print(f"--tune-pallas: jax_flash.pallas is not available ({e})")
        return
    import inspect

    offered = dict(
        head_dims=args.head_dims,
        seq_lens=args.seq_lens,
        dtype=args.dtype,
        batch=args.batch,
        heads=args.heads,
        num_heads=args.heads,
    )
    params = inspect.signature(tune).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    print(f"tuning Pallas block sizes: jax_flash.pallas._tune.tune({kwargs})")
    result = tune(**kwargs)
    if result is not None:
        print(result)
