"""Benchmarks of jax_flash against its peers: `python -m jax_flash.bench [flags]`.

One module per section; the command line (`cli.main`) picks the section by its flag:

- `attention`     (no flag) throughput and compiled temporary memory of `jax_flash.attention`
                  and the peers, forward and forward+backward; `--plot` (`plot`), `--tune-pallas`
                  (`pallas_tuning`), the CPU's peak and the core probe (`cpu_peak`);
- `decode`        `--decode`: one decode step against a KV cache, contiguous and paged;
- `flex`          `--flex`: flex_attention with a block mask (packed documents, a window with a
                  prefix) against the built-in masks, a dense mask and jax.nn;
- `multi_device`  `--multi-device`: ring attention against one device and the all-gather
                  fallback at a fixed global sequence length;
- `peak_memory`   `--peak-memory`: the peak resident memory of one call, each cell in a process
                  of its own;
- `common`        what the sections share (the environment, memory sizes, failure reports).

The package is a tool, not part of the library: no module of jax_flash outside it imports it.
"""

from jax_flash.bench.attention import (
    BIASES,
    CUT,
    FLASH,
    PEERS,
    Result,
    available_impls,
    bias_shape,
    format_table,
    measure,
    measure_case,
    parse_args,
    status_counts,
    torch_unavailable,  # noqa: F401  (why torch is not measured here; the tests ask it)
)
from jax_flash.bench.cli import main
from jax_flash.bench.common import environment
from jax_flash.bench.cpu_peak import cpu_peaks, format_peaks
from jax_flash.bench.multi_device import DeviceResult, count_collectives, measure_multi_device

__all__ = [
    "BIASES",
    "CUT",
    "FLASH",
    "PEERS",
    "DeviceResult",
    "Result",
    "available_impls",
    "bias_shape",
    "count_collectives",
    "cpu_peaks",
    "environment",
    "format_peaks",
    "format_table",
    "main",
    "measure",
    "measure_case",
    "measure_multi_device",
    "parse_args",
    "status_counts",
]
