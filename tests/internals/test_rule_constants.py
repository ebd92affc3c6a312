"""The kernels' facts that the scheduling rules count in, against the kernels themselves.

jax_flash/_heuristics.py states, once, the tile shapes and limits of the compiled kernels that
its rules count in: the cpu kernels' 128-row / 128-key blocks (CPU_BLOCK), the cuda forward's
query rows per CTA (CUDA_FORWARD_BLOCK_Q), the cuda forward's keys per tile and the backward's
keys per CTA by head dim and layout (cuda_forward_block_kv, cuda_backward_block_kv), the head
dims with warp32 kernels of their own (WARP32_HEAD_DIMS) and the warps that `explain` names
(cuda_layout_description); jax_flash/_config.py the cpu backward's largest forced gradient
chunk count (MAX_GRADIENT_CHUNKS). Each is compared here with its definition in C++: a small
program compiled for the host (the CUDA headers with JAX_FLASH_EMULATE, as the emulator and
tests/internals/test_tile_classifier.py compile them) prints kernels/tile.h TileShapeFor and
HasOwnShape over every compiled (H, Hv) pair and both layouts, and cpu/tiling.h kBlockQ,
kBlockK and kMaxGradientChunks; the built extension's cpu_blocking and cpu_gradient_chunks
answer for the cpu kernels as linked. A change on either side fails here.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from jax_flash import _config, _heuristics, cuda
from jax_flash._spec import AttentionSpec

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "cuda" / "kernels" / "tile.h").exists())
CUDA_DIR = ROOT / "cuda"
CXX = os.environ.get("CXX", "g++")
LAYOUTS = {"warp16": "kWarp16", "warp32": "kWarp32"}
PASSES = {"forward": "kForward", "backward": "kBackward", "backward_dq": "kBackwardDq"}

# Prints the tile shapes of the (H, Hv) pairs given as arguments ("H,Hv") and the cpu
# kernels' blocks as one JSON object.
PROGRAM = r"""
#define JAX_FLASH_EMULATE 1
#include <cstdio>
#include <cstdlib>
#include "cpu/tiling.h"
#include "kernels/tile.h"
namespace k = jax_flash::kernels;
namespace c = jax_flash::cpu;
int main(int argc, char** argv) {
  const k::Pass passes[] = {k::Pass::kForward, k::Pass::kBackward, k::Pass::kBackwardDq};
  const char* pass_names[] = {"forward", "backward", "backward_dq"};
  const k::Layout layouts[] = {k::Layout::kWarp16, k::Layout::kWarp32};
  const char* layout_names[] = {"warp16", "warp32"};
  std::printf("{\"cpu\": {\"block_q\": %lld, \"block_k\": %lld, \"max_gradient_chunks\": %lld}, \"cuda\": [",
              (long long)c::kBlockQ, (long long)c::kBlockK, (long long)c::kMaxGradientChunks);
  const char* sep = "";
  for (int i = 1; i < argc; ++i) {
    int h = 0, hv = 0;
    if (std::sscanf(argv[i], "%d,%d", &h, &hv) != 2) return 2;
    for (int p = 0; p < 3; ++p)
      for (int l = 0; l < 2; ++l) {
        const k::TileShape s = k::TileShapeFor(passes[p], h, hv, layouts[l]);
        std::printf("%s{\"h\": %d, \"hv\": %d, \"pass\": \"%s\", \"layout\": \"%s\", \"block_q\": %d, "
                    "\"block_kv\": %d, \"warps\": %d, \"rows_per_warp\": %d, \"col_splits\": %d, "
                    "\"own_shape\": %s}",
                    sep, h, hv, pass_names[p], layout_names[l], s.block_q, s.block_kv, s.warps, s.rows_per_warp,
                    s.col_splits, k::HasOwnShape(passes[p], h, hv, layouts[l]) ? "true" : "false");
        sep = ", ";
      }
    const k::TileShape d = k::DecodeForwardShape(h, hv);
    std::printf(", {\"h\": %d, \"hv\": %d, \"pass\": \"decode\", \"layout\": \"warp16\", \"block_q\": %d, "
                "\"block_kv\": %d, \"warps\": %d, \"rows_per_warp\": %d, \"col_splits\": %d, \"own_shape\": true}",
                h, hv, d.block_q, d.block_kv, d.warps, d.rows_per_warp, d.col_splits);
  }
  std::printf("]}\n");
  return 0;
}
"""


def _kernel_facts(out_dir: pathlib.Path, include_first: pathlib.Path | None = None) -> dict:
    """What the C++ headers define, for every compiled (H, Hv) pair (cuda.head_dim_pairs())."""
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")
    source, exe = out_dir / "rule_constants.cc", out_dir / "rule_constants"
    source.write_text(PROGRAM)
    includes = ([f"-I{include_first}"] if include_first else []) + [f"-I{CUDA_DIR}"]
    build = subprocess.run(
        [CXX, "-std=c++17", "-O0", "-Wall", "-Wno-unknown-pragmas", *includes, str(source), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, f"compiling the tile shape program failed:\n{build.stderr}"
    pairs = [f"{h},{hv}" for h, hv in cuda.head_dim_pairs()]
    run = subprocess.run([str(exe), *pairs], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def kernel_facts(tmp_path_factory):
    return _kernel_facts(tmp_path_factory.mktemp("rule_constants"))


def _spec(h: int, hv: int, layout: str) -> AttentionSpec:
    config = _config.resolve(_config.Config(cuda_layout=layout))
    return AttentionSpec(1, 256, 1024, 8, 8, h, "bfloat16", 0.125, value_head_dim=hv, config=config)


def _cuda_mismatches(facts: dict) -> list[str]:
    """Where the rules' cuda tile facts differ from kernels/tile.h; [] when none do."""
    wrong = []
    shapes = {(s["h"], s["hv"], s["pass"], s["layout"]): s for s in facts["cuda"]}
    for h, hv in cuda.head_dim_pairs():
        for layout in LAYOUTS:
            spec, where = _spec(h, hv, layout), f"(H, Hv) = ({h}, {hv}), {layout}"
            fwd, bwd = shapes[(h, hv, "forward", layout)], shapes[(h, hv, "backward", layout)]
            if fwd["block_q"] != _heuristics.CUDA_FORWARD_BLOCK_Q:
                wrong.append(f"{where}: forward block_q {fwd['block_q']} != {_heuristics.CUDA_FORWARD_BLOCK_Q}")
            if fwd["block_kv"] != _heuristics.cuda_forward_block_kv(spec):
                wrong.append(
                    f"{where}: forward block_kv {fwd['block_kv']} != {_heuristics.cuda_forward_block_kv(spec)}"
                )
            if bwd["block_kv"] != _heuristics.cuda_backward_block_kv(spec):
                wrong.append(
                    f"{where}: backward block_kv {bwd['block_kv']} != {_heuristics.cuda_backward_block_kv(spec)}"
                )
            # The warps that `explain` names for the call's kernels.
            words = _heuristics.cuda_layout_description(spec)
            forward_words = f"forward {fwd['warps']} warps x {fwd['rows_per_warp']} rows"
            backward_words = f"backward {bwd['block_kv']} keys per CTA"
            if bwd["col_splits"] > 1:
                backward_words += f", {bwd['col_splits']} warps per 16 keys"
            for expected in (forward_words, backward_words):
                if expected not in words:
                    wrong.append(f"{where}: explain says {words!r}, the kernels {expected!r}")
            if bwd["col_splits"] == 1 and "warps per 16 keys" in words:
                wrong.append(f"{where}: explain says {words!r}, the backward has one warp per 16 keys")
        # The decoding tile (DecodeForwardShape): its rows and keys, and the warps `explain` names.
        dec, where = shapes[(h, hv, "decode", "warp16")], f"(H, Hv) = ({h}, {hv}), decoding tile"
        spec = _spec(h, hv, "warp16")
        if dec["block_q"] != _heuristics.CUDA_DECODE_BLOCK_Q or dec["warps"] * dec["rows_per_warp"] != dec["block_q"]:
            wrong.append(f"{where}: block_q {dec['block_q']} != {_heuristics.CUDA_DECODE_BLOCK_Q}")
        if dec["block_kv"] != _heuristics.cuda_decode_block_kv(spec):
            wrong.append(f"{where}: block_kv {dec['block_kv']} != {_heuristics.cuda_decode_block_kv(spec)}")
        decode_spec = AttentionSpec(1, 1, 1024, 4, 1, h, "bfloat16", 0.125, value_head_dim=hv)
        words = _heuristics.cuda_forward_kernel_description(decode_spec, 132)
        expected = f"{dec['block_q']}x{dec['block_kv']} tiles, one warp of {dec['rows_per_warp']} rows"
        if dec["warps"] != 1 or expected not in words:
            wrong.append(f"{where}: explain says {words!r}, the kernels {dec['warps']} warp(s), {expected!r}")
    # The head dims with a warp32 kernel of its own (HasOwnShape), over the Hv = H pairs.
    for pass_ in ("forward", "backward"):
        own = tuple(h for h in cuda.HEAD_DIMS if shapes[(h, h, pass_, "warp32")]["own_shape"])
        if tuple(_heuristics.WARP32_HEAD_DIMS[pass_]) != own:
            wrong.append(f"{pass_}: WARP32_HEAD_DIMS {_heuristics.WARP32_HEAD_DIMS[pass_]} != HasOwnShape's {own}")
    return wrong


def _cpu_mismatches(facts: dict) -> list[str]:
    """Where the rules' cpu facts differ from cpu/tiling.h; [] when none do."""
    wrong = []
    cpu = facts["cpu"]
    for name in ("block_q", "block_k"):
        if cpu[name] != _heuristics.CPU_BLOCK:
            wrong.append(f"cpu/tiling.h {name} {cpu[name]} != CPU_BLOCK {_heuristics.CPU_BLOCK}")
    if cpu["max_gradient_chunks"] != _config.MAX_GRADIENT_CHUNKS:
        wrong.append(
            f"cpu/tiling.h kMaxGradientChunks {cpu['max_gradient_chunks']} != "
            f"MAX_GRADIENT_CHUNKS {_config.MAX_GRADIENT_CHUNKS}"
        )
    return wrong


def test_cuda_tile_facts_match_the_kernels(kernel_facts):
    # Every compiled pair, both layouts, the three passes: a list gone short would pass vacuously.
    assert len(kernel_facts["cuda"]) == (3 * len(LAYOUTS) + 1) * len(cuda.head_dim_pairs())
    assert _cuda_mismatches(kernel_facts) == []


def test_cpu_tile_facts_match_the_kernels(kernel_facts):
    assert _cpu_mismatches(kernel_facts) == []


def test_cpu_blocks_match_the_built_extension():
    ext = pytest.importorskip("jax_flash._jax_flash_ext")
    for h in sorted({8, 64, 100, 128, 256, 512, *cuda.HEAD_DIMS}):
        for dtype in ("float32", "bfloat16", "float16"):
            for bf16_products in (False, True):
                blocking = ext.cpu_blocking(h, dtype, bf16_products)
                assert (blocking["block_q"], blocking["block_k"]) == (_heuristics.CPU_BLOCK,) * 2, (h, dtype)
    # The backward's rule caps its chunks where Config's range ends: many threads, many key blocks.
    assert ext.cpu_gradient_chunks(1, 1, 1, 1, 64 * _heuristics.CPU_BLOCK, 64, 1 << 20) == _config.MAX_GRADIENT_CHUNKS
    # ... and just enough key blocks for that many chunks, one fewer for one fewer.
    most = _config.MAX_GRADIENT_CHUNKS
    assert ext.cpu_gradient_chunks(1, 1, 1, 1, most * _heuristics.CPU_BLOCK, 64, 1 << 20) == most
    assert ext.cpu_gradient_chunks(1, 1, 1, 1, (most - 1) * _heuristics.CPU_BLOCK, 64, 1 << 20) == most - 1
    # Config accepts exactly the range the handler does.
    _config.Config(cpu_gradient_chunks=most)
    with pytest.raises(ValueError):
        _config.Config(cpu_gradient_chunks=most + 1)


def test_cuda_gqa_packing_bound_is_the_forward_tile():
    # The cuda handler bounds G for pack_gqa (kernels/ffi_attention.h, boundary::CheckGqaPacking)
    # by the rows of the forward tile it launches: the decoding tile's (kDecodeRows, its
    # DecodeForwardShape's block_q, checked against CUDA_DECODE_BLOCK_Q above) with decode_tile,
    # else TileShapeFor(Pass::kForward, ...).block_q (checked against CUDA_FORWARD_BLOCK_Q),
    # never by a literal of its own.
    text = (CUDA_DIR / "kernels" / "ffi_attention.h").read_text()
    calls = re.findall(r"CheckGqaPacking\(\s*check\s*,\s*pack_gqa\s*,\s*(.+?),\s*b\s*\);", text, re.S)
    assert calls == ["rows"], calls
    rows = re.search(r"const int rows =\s*(.+?);", text, re.S)
    assert rows, "no rows bound before CheckGqaPacking in cuda/kernels/ffi_attention.h"
    bound = " ".join(rows.group(1).split())
    assert bound == (
        "decode_tile ? kDecodeRows : TileShapeFor(Pass::kForward, b.head_dim, b.v_head_dim, layout).block_q"
    ), bound
    tile = (CUDA_DIR / "kernels" / "tile.h").read_text()
    assert "constexpr int kDecodeRows = DecodeForwardShape(128, 128).block_q;" in tile


# A Python constant changed by one step: each must show as a mismatch.
PYTHON_MUTANTS = {
    "CPU_BLOCK": ("CPU_BLOCK", 64),
    "CUDA_FORWARD_BLOCK_Q": ("CUDA_FORWARD_BLOCK_Q", 64),
    "CUDA_DECODE_BLOCK_Q": ("CUDA_DECODE_BLOCK_Q", 32),
    "WARP32_HEAD_DIMS": ("WARP32_HEAD_DIMS", {"forward": (32, 64, 96), "backward": (32, 64, 96)}),
}


@pytest.mark.parametrize("name", sorted(PYTHON_MUTANTS))
def test_a_changed_rule_constant_is_caught(kernel_facts, monkeypatch, name):
    attribute, value = PYTHON_MUTANTS[name]
    monkeypatch.setattr(_heuristics, attribute, value)
    assert _cuda_mismatches(kernel_facts) + _cpu_mismatches(kernel_facts) != []


def test_a_changed_gradient_chunk_limit_is_caught(kernel_facts, monkeypatch):
    monkeypatch.setattr(_config, "MAX_GRADIENT_CHUNKS", _config.MAX_GRADIENT_CHUNKS + 1)
    assert _cpu_mismatches(kernel_facts) != []


def test_a_changed_kernel_tile_is_caught(tmp_path):
    # kernels/tile.h with the warp32 backward at H <= 64 on 64 keys per CTA, not 128.
    text, replacement = "return TileShape{64, 128, 8, 2, 16};", "return TileShape{64, 64, 8, 2, 16};"
    original = (CUDA_DIR / "kernels" / "tile.h").read_text()
    assert original.count(text) == 1, f"the mutant's text {text!r} is no longer in cuda/kernels/tile.h once"
    patched = tmp_path / "include" / "kernels" / "tile.h"
    patched.parent.mkdir(parents=True)
    patched.write_text(original.replace(text, replacement))
    wrong = _cuda_mismatches(_kernel_facts(tmp_path, tmp_path / "include"))
    assert any("backward block_kv 64 != 128" in line for line in wrong), wrong
