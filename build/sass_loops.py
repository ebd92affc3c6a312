#!/usr/bin/env python3
"""The steady-state key loop of a CUDA kernel, read from its SASS, and what it costs per MMA.

A loop is the address range [target, branch] of a backward branch (`BRA` to an address at or
before its own). A kernel's key loop is the loop holding the most HMMA; among loops with as
many (the plain forward's masked and interior loops run the same MMAs), the one with the
fewest instructions: the interior loop, which the masked ones only add to. Everything in its
address range is counted, cold code too (a branch around it still costs its bytes and, where
taken, its time): that is what a per-score branch or a feature test inside the loop shows up
as. Loops nested inside the key loop (a rolled k-step loop) are counted once, so a kernel with
one reads low; `inner_loops` says how many there are.

    python build/sass_loops.py OBJ_OR_SASS [--function SUBSTRING] [--arch 90]

prints, per (arch, function), the key loop's instructions, HMMA, LDSM, branches and the
instruction classes per HMMA. `build/check_static.py` holds the main kernels to budgets with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import subprocess
import sys

_ARCH = re.compile(r"^\s*arch = sm_(\d+)")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
# "        /*0630*/              @!P0 BRA 0x710 ;"
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")

# Instruction classes (by the opcode's first word).
CLASSES = {
    "hmma": ("HMMA",),
    "ldsm": ("LDSM",),
    "branch": ("BRA", "BSSY", "BSYNC", "BRX", "JMP", "WARPSYNC"),
    "fsetp_fsel": ("FSETP", "FSEL", "FCHK"),
    "fmul_fadd": ("FMUL", "FADD"),
    "ffma": ("FFMA",),
    "mufu": ("MUFU",),
    "fmnmx": ("FMNMX",),
    "integer": ("IADD3", "IMAD", "LEA", "LOP3", "SHF", "ISETP", "IABS", "SEL", "MOV", "IMNMX", "PRMT", "SGXT"),
    "copy": ("LDGSTS", "LDGDEPBAR", "DEPBAR"),
    "barrier": ("BAR",),
    "shuffle": ("SHFL",),
    "convert": ("F2FP", "F2F", "I2F", "F2I"),
}


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with modifiers: HMMA.16816.F32.BF16
    predicated: bool
    operands: str

    @property
    def word(self) -> str:
        return self.opcode.split(".")[0]

    def branch_target(self) -> int | None:
        if self.word != "BRA":
            return None
        m = _TARGET.search(self.operands)
        return int(m.group(1), 16) if m else None


@dataclasses.dataclass
class KeyLoop:
    start: int
    end: int
    instructions: list[Instruction]
    inner_loops: int

    def count(self, cls: str) -> int:
        words = CLASSES[cls]
        return sum(1 for i in self.instructions if i.word in words)

    @property
    def hmma(self) -> int:
        return self.count("hmma")

    def per_hmma(self, cls: str | None = None) -> float:
        n = len(self.instructions) if cls is None else self.count(cls)
        return n / self.hmma if self.hmma else float("inf")

    def summary(self) -> dict:
        out = {
            "instructions": len(self.instructions),
            "hmma": self.hmma,
            "per_hmma": round(self.per_hmma(), 2),
            "inner_loops": self.inner_loops,
        }
        for cls in CLASSES:
            if cls != "hmma":
                out[cls] = round(self.per_hmma(cls), 3)
        return out


def parse(sass: str) -> dict[tuple[int, str], list[Instruction]]:
    """{(arch, mangled function name): instructions in address order} of cuobjdump -sass output."""
    out: dict[tuple[int, str], list[Instruction]] = {}
    arch, func = 0, None
    for line in sass.splitlines():
        m = _ARCH.match(line)
        if m:
            arch = int(m.group(1))
            continue
        m = _FUNCTION.match(line)
        if m:
            func = m.group(1)
            out[(arch, func)] = []
            continue
        m = _INSTRUCTION.match(line)
        if m and func is not None:
            out[(arch, func)].append(
                Instruction(int(m.group(1), 16), m.group(3), m.group(2) is not None, m.group(4).strip())
            )
    return out


def loops(instructions: list[Instruction]) -> list[tuple[int, int]]:
    """(start, end) address ranges of the backward branches."""
    found = []
    for ins in instructions:
        target = ins.branch_target()
        if target is not None and target <= ins.address:
            found.append((target, ins.address))
    return found


def key_loop(instructions: list[Instruction]) -> KeyLoop | None:
    """The loop with the most HMMA (ties: the fewest instructions), or None without one."""
    best = None
    ranges = loops(instructions)
    for start, end in ranges:
        body = [i for i in instructions if start <= i.address <= end]
        hmma = sum(1 for i in body if i.word == "HMMA")
        if hmma == 0:
            continue
        key = (-hmma, len(body))
        if best is None or key < best[0]:
            inner = sum(1 for s, e in ranges if start <= s and e <= end and (s, e) != (start, end))
            best = (key, KeyLoop(start, end, body, inner))
    return None if best is None else best[1]


def weighted(loop: KeyLoop, instructions: list[Instruction], hmma_per_step: int) -> KeyLoop:
    """The key loop with its one rolled inner loop (a k-step loop) counted as many times as it
    runs, which `hmma_per_step` (the MMAs one key step of a warp issues, from the kernel's tile
    traits) tells: the loop's HMMA outside the inner loop plus n times those inside it make
    hmma_per_step. Unchanged without an inner loop."""
    inner = [
        (s, e) for s, e in loops(instructions) if loop.start <= s and e <= loop.end and (s, e) != (loop.start, loop.end)
    ]
    if not inner or loop.hmma >= hmma_per_step:
        return loop
    if len(inner) != 1:
        raise ValueError(f"{len(inner)} loops inside the key loop: cannot weight them")
    s, e = inner[0]
    body = [i for i in loop.instructions if s <= i.address <= e]
    inner_hmma = sum(1 for i in body if i.word == "HMMA")
    runs, rest = divmod(hmma_per_step - (loop.hmma - inner_hmma), inner_hmma)
    if rest or runs < 1:
        raise ValueError(f"the inner loop's {inner_hmma} HMMA do not make up {hmma_per_step} per key step")
    return KeyLoop(loop.start, loop.end, loop.instructions + body * (runs - 1), 0)


def sass_of(path: pathlib.Path, cuobjdump: str = "cuobjdump") -> str:
    if path.suffix == ".sass":
        return path.read_text()
    return subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=pathlib.Path, help="an object / cubin (cuobjdump -sass) or a .sass listing")
    parser.add_argument("--function", default="", help="only functions whose mangled name contains this")
    parser.add_argument("--arch", type=int, default=0, help="only this sm_XY")
    args = parser.parse_args()
    for (arch, func), instructions in parse(sass_of(args.path)).items():
        if args.function not in func or (args.arch and arch != args.arch):
            continue
        loop = key_loop(instructions)
        if loop is None:
            continue
        print(f"sm_{arch} {func}")
        print("  " + ", ".join(f"{k} {v}" for k, v in loop.summary().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
