"""`--plot`: the attention table's throughput as a PNG (matplotlib, the `[bench]` extra)."""

from __future__ import annotations

import sys

from jax_flash.bench.common import Result


def require_matplotlib() -> None:
    """Exits with a message (status 1) if `--plot` cannot work here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        sys.exit(f"--plot needs matplotlib ({e}): pip install \".[bench]\" (or matplotlib)")


def write_plot(results: list[Result], path: str, on_gpu: bool) -> None:
    import matplotlib  # lazily: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, div = ("TFLOP/s", 1e12) if on_gpu else ("GFLOP/s", 1e9)
    passes = sorted({r.pass_ for r in results}, key=("fwd", "fwdbwd").index)
    causals = sorted({r.causal for r in results})
    fig, axes = plt.subplots(
        len(passes), len(causals), figsize=(5.5 * len(causals), 4 * len(passes)), squeeze=False
    )
    panels = [(ax, p, c) for row, p in zip(axes, passes) for ax, c in zip(row, causals)]
    for ax, pass_, causal in panels:
        series = {}
        for r in results:
            if (r.pass_, r.causal) == (pass_, causal) and r.flops_per_s is not None:
                series.setdefault((r.impl, r.head_dim), []).append((r.seq_len, r.flops_per_s / div))
        for (impl, h), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{impl} H={h}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T = S")
        ax.set_ylabel(unit)
        ax.set_title(f"{pass_}, {'causal' if causal else 'not causal'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
