"""`python -m jax_flash.bench [--decode | --flex | --multi-device | --peak-memory |
--write-choices BENCH_JSON...] [options]`: the section a flag names, or the attention table."""

from __future__ import annotations

import sys
from typing import Any

from jax_flash.bench import attention, choices, decode, flex, multi_device, peak_memory


def main(argv=None) -> list[Any] | dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--peak-memory-probe" in argv:
        return peak_memory.peak_memory_probe(argv[argv.index("--peak-memory-probe") + 1 :])
    if "--peak-memory" in argv:
        return peak_memory.peak_memory_main(argv)
    if "--multi-device" in argv:
        return multi_device.multi_device_main(argv)
    if "--decode" in argv:  # one decode step against a KV cache (jax_flash/bench/decode.py)
        return decode.main(argv)
    if "--write-choices" in argv:  # a GPU run's bench.json into the measured choices (choices.py)
        return choices.main(argv)
    if "--flex" in argv:  # flex_attention with a block mask vs the built-in, dense and jax.nn paths
        return flex.main(argv)
    return attention.main(argv)
