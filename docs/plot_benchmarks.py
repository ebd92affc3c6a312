"""The plots of docs/benchmarks.md, drawn from the recorded table on that page (section
"Measured: 2-core CPU, 2026-12-02") by the bench's own `--plot` (`jax_flash.bench.plot`), one
PNG per dtype: model GFLOP/s of `cpu`, torch and jax.nn against the sequence length.

    python docs/plot_benchmarks.py            # rewrites docs/_static/bench-cpu-<dtype>.png

The table is the data: a cell's FLOP count is the `cpu` rate times its time, and each peer's
rate is that count over the peer's time (the same model FLOPs, as the bench counts them).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_flash.bench.common import Result  # noqa: E402
from jax_flash.bench.plot import write_plot  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks.md"
SECTION = "## Measured: 2-core CPU, 2026-12-02"
DTYPES = {"bf16": "bfloat16", "f32": "float32"}  # f16 has no jax.nn column (it cannot compile f16 dots on a CPU)


def _ms(text: str) -> float | None:
    m = re.match(r"([\d,.]+) ms", text.strip())
    return float(m.group(1).replace(",", "")) / 1e3 if m else None


def recorded() -> list[Result]:
    """The rows of the recorded table as bench Results (cpu, torch, jax.nn)."""
    text = PAGE.read_text()
    table = text[text.index(SECTION) :]
    results = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or cells[0] not in DTYPES:
            continue
        dtype, h, t, causal, pass_, cpu, torch, _, jnn, _ = cells
        cpu_time = _ms(cpu)
        rate = float(re.search(r"([\d,.]+) GFLOP/s", cpu).group(1).replace(",", "")) * 1e9
        flops = rate * cpu_time
        seq = int(t.rstrip("k")) * 1024
        for impl, time in (("cpu", cpu_time), ("torch", _ms(torch)), ("jax.nn", _ms(jnn))):
            if time is not None:
                results.append(
                    Result(
                        impl=impl,
                        pass_=pass_,
                        causal=causal == "yes",
                        head_dim=int(h),
                        seq_len=seq,
                        batch=1,
                        heads=8,
                        dtype=DTYPES[dtype],
                        flops=flops,
                        time_s=time,
                        flops_per_s=flops / time,
                    )
                )
    return results


def main(out_dir: Path = ROOT / "docs" / "_static") -> list[Path]:
    results = recorded()
    paths = []
    for short, dtype in DTYPES.items():
        path = out_dir / f"bench-cpu-{short}.png"
        write_plot([r for r in results if r.dtype == dtype], str(path), on_gpu=False)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "_static"):
        print("wrote", p)
