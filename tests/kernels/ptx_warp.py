"""A model of one warp running a block of inline PTX, for the kernels whose PTX no CPU can run.

``run_warp(asm, operands, memory)`` runs ``asm`` (the text of a Triton ``inline_asm_elementwise`` block)
for 32 lanes in step (or one, for a block without an MMA). It knows the instructions the pack's 4-bit
tiles use, each modelled from the PTX ISA, not from the pack: ``mov``, ``setp`` (ne / gt), ``and.pred``,
``shl`` / ``shr`` / ``and``, ``lop3`` (the immediate a truth table over a = 0xF0, b = 0xCC, c = 0xAA),
``prmt`` (default mode: byte i of the result is byte ``sel_i & 7`` of ``{b, a}``, its sign replicated
when bit 3 is set), predicated ``ld.global...v4.b32`` from ``memory``, ``fma.rn.bf16x2`` /
``fma.rn.f16x2`` (float64 then rounded to the half type), and
``mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}`` with PTX's fragment layout: lane l = 4 g + t holds
A's (row g | g + 8, columns 2t, 2t + 1 | 2t + 8, 2t + 9) in a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t +
8..), a3 (g + 8, 2t + 8..); B's (rows 2t, 2t + 1 | 2t + 8, 2t + 9; column g) in b0, b1; D's (row g | g +
8; columns 2t, 2t + 1) in d0..d3. The low half of a 32-bit register is the lower index. An instruction
it does not know fails.
"""

from __future__ import annotations

import re
import struct

import torch

MASK = 0xFFFFFFFF


class Memory:
    """Bytes at addresses: ``add(tensor)`` places a copy of a tensor's elements, row-major, and returns its
    base address."""

    def __init__(self):
        self.blocks: list[tuple[int, bytes]] = []
        self.next = 1 << 20

    def add(self, t: torch.Tensor) -> int:
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        base = self.next
        self.blocks.append((base, data))
        self.next += (len(data) + 4096) // 256 * 256 + 256
        return base

    def word(self, addr: int) -> int:
        for base, data in self.blocks:
            if base <= addr and addr + 4 <= base + len(data):
                return int.from_bytes(data[addr - base:addr - base + 4], "little")
        raise AssertionError(f"a load outside every tensor: {addr:#x}")


def _half(bits: int, kind: str) -> float:
    raw = (bits << 16).to_bytes(4, "little") if kind == "bf16" else bits.to_bytes(2, "little")
    return struct.unpack("<f" if kind == "bf16" else "<e", raw)[0]


def _bits(value: float, kind: str) -> int:
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    return torch.tensor([value], dtype=torch.float64).to(dtype).view(torch.int16).item() & 0xFFFF


def _halves(reg: int, kind: str) -> tuple[float, float]:
    return _half(reg & 0xFFFF, kind), _half(reg >> 16, kind)


def _statements(asm: str) -> list[str]:
    out = []
    for stmt in asm.replace("{\n", ";").replace("\n}", ";").replace("\n", ";").split(";"):
        stmt = stmt.strip()
        if stmt and stmt not in "{}" and not stmt.startswith(".reg"):
            out.append(stmt)
    return out


def _args(text: str) -> list[str]:
    # "a, {b, c}, [d+4]" -> ["a", "{b, c}", "[d+4]"]
    return [a.strip() for a in re.findall(r"\s*(\{[^}]*\}|\[[^\]]*\]|[^,]+)", text)]


def _lane(r: dict, op: str, args: list[str], memory: Memory | None) -> None:
    """One instruction (not an MMA) of one lane whose registers are ``r``."""
    def val(tok: str):
        tok = tok.strip()
        return r[tok] if tok in r else int(tok, 0) & MASK

    if op.startswith("ld.global") and op.endswith(".v4.b32"):
        m = re.fullmatch(r"\[(\$\d+)\+(\d+)\]", args[1])
        addr = r[m.group(1)] + int(m.group(2))
        for j, d in enumerate(args[0].strip("{}").split(",")):
            r[d.strip()] = memory.word(addr + 4 * j)
        return
    d, src = args[0], args[1:]
    if op in ("mov.b32", "mov.f32"):
        r[d] = val(src[0])
    elif op == "setp.ne.b32":
        r[d] = val(src[0]) != val(src[1])
    elif op == "setp.gt.s32":
        a, b = (v - (1 << 32) if v >= 1 << 31 else v for v in (val(src[0]), val(src[1])))
        r[d] = a > b
    elif op == "and.pred":
        r[d] = r[src[0]] and r[src[1]]
    elif op == "shl.b32":
        r[d] = (val(src[0]) << val(src[1])) & MASK
    elif op == "shr.b32":
        r[d] = val(src[0]) >> val(src[1])
    elif op == "and.b32":
        r[d] = val(src[0]) & val(src[1])
    elif op == "prmt.b32":
        a, b, sel = (val(t) for t in src)
        pool, out = a | (b << 32), 0
        for i in range(4):
            s = (sel >> (4 * i)) & 15
            byte = (pool >> (8 * (s & 7))) & 255
            if s & 8:
                byte = 255 if byte & 128 else 0
            out |= byte << (8 * i)
        r[d] = out
    elif op == "lop3.b32":
        a, b, c, lut = (val(t) for t in src)
        out = 0
        for ia in (0, 1):
            for ib in (0, 1):
                for ic in (0, 1):
                    if (lut >> (4 * ia + 2 * ib + ic)) & 1:
                        out |= (a if ia else ~a) & (b if ib else ~b) & (c if ic else ~c) & MASK
        r[d] = out
    elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
        kind = op.split(".")[-1][:-2]
        a, b, c = (_halves(val(t), kind) for t in src)
        lo, hi = (_bits(a[i] * b[i] + c[i], kind) for i in (0, 1))
        r[d] = lo | (hi << 16)
    else:
        raise AssertionError(f"unmodelled PTX: {op}")


def run_warp(asm: str, operands: list[list], memory: Memory | None = None) -> list[list]:
    """Run ``asm`` for ``len(operands)`` lanes in step (32 where it has an MMA); ``operands[l]`` are
    lane l's ``$0, $1, ...`` (outputs first, any value; float32 operands as Python floats, the rest
    as integers). Returns each lane's operands after the block."""
    regs = [{f"${i}": v for i, v in enumerate(ops)} for ops in operands]
    for stmt in _statements(asm):
        pred = None
        if stmt.startswith("@"):
            pred, stmt = stmt[1:].split(None, 1)
        op, rest = stmt.split(None, 1)
        args = _args(rest)
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            assert len(regs) == 32, "an MMA needs the whole warp"
            _mma(regs, args, op.split(".")[-3])
            continue
        for r in regs:
            if pred is None or r[pred]:
                _lane(r, op, args, memory)
    return [[r[f"${i}"] for i in range(len(operands[0]))] for r in regs]


def _mma(regs: list[dict], args: list[str], kind: str) -> None:
    d, a, b, c = ([t.strip() for t in arg.strip("{}").split(",")] for arg in args)
    A = [[0.0] * 16 for _ in range(16)]
    B = [[0.0] * 8 for _ in range(16)]
    C = [[0.0] * 8 for _ in range(16)]
    for lane in range(32):
        g, t, r = lane >> 2, lane & 3, regs[lane]
        for reg, row, col in ((a[0], g, 2 * t), (a[1], g + 8, 2 * t), (a[2], g, 2 * t + 8), (a[3], g + 8, 2 * t + 8)):
            A[row][col], A[row][col + 1] = _halves(r[reg], kind)
        for reg, k in ((b[0], 2 * t), (b[1], 2 * t + 8)):
            B[k][g], B[k + 1][g] = _halves(r[reg], kind)
        for reg, row, col in ((c[0], g, 2 * t), (c[1], g, 2 * t + 1), (c[2], g + 8, 2 * t), (c[3], g + 8, 2 * t + 1)):
            C[row][col] = float(r[reg])
    D = (torch.tensor(A, dtype=torch.float64) @ torch.tensor(B, dtype=torch.float64)
         + torch.tensor(C, dtype=torch.float64)).float().tolist()
    for lane in range(32):
        g, t, r = lane >> 2, lane & 3, regs[lane]
        for reg, row, col in ((d[0], g, 2 * t), (d[1], g, 2 * t + 1), (d[2], g + 8, 2 * t), (d[3], g + 8, 2 * t + 1)):
            r[reg] = D[row][col]
