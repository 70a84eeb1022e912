"""Read a compiled (post-optimization) HLO module's text: instructions, loop trip counts, dot FLOPs, GEMMs.

The text is the one stable view of an XLA program that every backend prints. What the inspector
needs from it:

    computations   name -> instructions (`%name = shape op(operands), attrs`)
    multiplier     how often a computation runs per step: the entry once, a `while` body `n` times
                   (its known_trip_count), everything it calls as often as it runs
    dot FLOPs      2 · |output| · |contracted dims| for each `dot` (and cuBLAS gemm custom call),
                   times its computation's multiplier

XLA's own cost analysis counts a `while` body once, so a scanned layer stack of L layers is
undercounted L-fold; `loop_dot_flops_uncounted()` is the correction (see aot.py).

`gemm_report()` counts the GEMMs a program runs by kind. XLA on NVIDIA GPUs lowers a dot to a cuBLAS(Lt)
custom call (`__cublas$gemm`, `__cublas$lt$matmul`, `__cublas$lt$matmul$f8` for fp8) or to a Triton GEMM
fusion; on the CPU it stays a `dot`. An fp8 GEMM is one whose two operands are f8 types; it runs at full
rate on Hopper only when both operands contract on their minor-most (contiguous) dimension, "K-major" / TN.

The parser also reads the unoptimized text (`jit(f).lower(...).as_text(dialect="hlo")`: names without
`%`, computations without a signature) and bare instruction lines outside any computation.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\((.*)\)\s*->\s*.*)?\{\s*$")
_OP = re.compile(r"\s([a-z][a-z0-9\-]*)\((.*)$")
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_TYPE = re.compile(r"([a-z][a-z0-9]*)\[[0-9,]*\](?:\{([0-9,]*))?")  # dtype, layout (minor to major)


@dataclass
class Instr:
    name: str
    shape: str  # the result's shape text: `f32[4,16]{1,0}` or a tuple `(f32[2], s32[])`
    op: str
    operands: list[str]
    attrs: str  # everything after the operand list
    computation: str
    args: str = ""  # the operand list as written (a parameter's index)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclass
class Module:
    computations: dict[str, list[Instr]] = field(default_factory=dict)
    entry: str = ""
    by_name: dict[str, Instr] = field(default_factory=dict)
    users: dict[str, list[Instr]] = field(default_factory=dict)

    def called(self, ins: Instr) -> list[tuple[str, int]]:
        """Computations `ins` runs and how many times per execution of `ins`."""
        if ins.op == "while":
            m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
            trips = int(m.group(1)) if m else 1
            return [(c, trips) for c in (ins.attr("body"), ins.attr("condition")) if c]
        out = [(c, 1) for key in ("calls", "to_apply", "true_computation", "false_computation")
               if ins.op not in ("all-reduce", "reduce-scatter", "all-reduce-start", "reduce", "reduce-window",
                                 "scatter", "select-and-scatter", "sort", "map")
               and (c := ins.attr(key))]
        m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        if m:
            out += [(c.strip().lstrip("%"), 1) for c in m.group(1).split(",")]
        return out


def bytes_of(shape: str) -> int:
    """Bytes of every array in a shape text (tuples summed); layouts and dynamic bounds ignored."""
    return sum(DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _ARRAY.findall(shape))


def dims_of(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _split_top(text: str) -> tuple[str, str]:
    """'a, b(c, d)), rest' -> ('a, b(c, d)', ', rest'): the operand list up to its closing paren."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return text[:i], text[i + 1:]
            depth -= 1
    return text, ""


def _pieces(text: str) -> list[str]:
    """'a, (b, c) d' -> ['a', '(b, c) d']: a list split at its top-level commas."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    return [p for p in out + [text[start:].strip()] if p]


def _operand_names(op: str, text: str) -> list[str]:
    """`%a, f32[2]{0} %b` as the optimized text prints operands, or `a, b` as the unoptimized one does."""
    if "%" in text:
        return re.findall(r"%([\w.\-]+)", text)
    if op in ("constant", "parameter"):  # their parentheses hold a value or an index
        return []
    return [t for p in _pieces(text) if _NAME.fullmatch(t := p.split()[-1])]


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2], s32[]) all-reduce(...' -> shape text and the text from the op name on."""
    if rest.startswith("("):
        inner, after = _split_top(rest[1:])
        return "(" + inner + ")", after
    shape, _, after = rest.partition(" ")
    return shape, " " + after


def parse(text: str) -> Module:
    """The module's computations; instruction lines outside any computation form the computation ""."""
    mod = Module()
    current = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            mod.computations[current] = []
            if header.group(1):
                mod.entry = current
            continue
        if line.startswith("}"):
            current = ""
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        shape, after = _split_shape(rest.strip())
        op_m = _OP.match(after)
        if not op_m:
            continue
        operand_text, attrs = _split_top(op_m.group(2))
        operands = _operand_names(op_m.group(1), operand_text)
        ins = Instr(name, shape, op_m.group(1), operands, attrs, current, operand_text)
        mod.computations.setdefault(current, []).append(ins)
        mod.by_name[name] = ins
        for o in operands:
            mod.users.setdefault(o, []).append(ins)
    return mod


def multipliers(mod: Module) -> dict[str, int]:
    """Executions per step of every computation reachable from the entry."""
    mult: dict[str, int] = {}

    def visit(comp: str, times: int) -> None:
        mult[comp] = mult.get(comp, 0) + times
        for ins in mod.computations.get(comp, []):
            for callee, n in mod.called(ins):
                if callee in mod.computations:
                    visit(callee, times * n)

    if mod.entry:
        visit(mod.entry, 1)
    return mult


def contracting_dims(ins: Instr, side: str) -> list[int]:
    """The `side` ("lhs" or "rhs") operand's contracting dims: a dot's `lhs_contracting_dims={1}` or a
    cuBLAS custom call's `"lhs_contracting_dimensions":["1"]` (in its backend config)."""
    m = re.search(side + r'_contracting_dims?(?:=\{([\d,]*)\}|ensions"\s*:\s*\[([^\]]*)\])', ins.attrs)
    if not m:
        return []
    raw = m.group(1) if m.group(1) is not None else m.group(2)
    return [int(v.strip('" ')) for v in raw.split(",") if v.strip('" ')]


def operand_types(ins: Instr, mod: Module) -> list[tuple[str, list[int]]]:
    """(dtype, layout minor-to-major) of each array operand: as typed in the operand list, else as defined."""
    out = []
    for piece in _pieces(ins.args):
        typed = _TYPE.match(piece) if " " in piece else None  # `f8e4m3fn[64,32]{1,0} %x`
        if typed is None and (d := mod.by_name.get(piece.split()[-1].lstrip("%"))):
            typed = _TYPE.match(d.shape)
        if typed:
            out.append((typed.group(1), [int(v) for v in (typed.group(2) or "").split(",") if v]))
    return out


def dot_flops(ins: Instr, mod: Module) -> float:
    """2 · output elements · contracted elements for a dot or a cuBLAS gemm custom call; 0 otherwise."""
    if ins.op == "dot":
        contracting = contracting_dims(ins, "lhs")
        out_shape = ins.shape
    elif ins.op == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)', ins.attrs):
        contracting = contracting_dims(ins, "lhs")
        out_shape = _ARRAY.search(ins.shape).group(0) if _ARRAY.search(ins.shape) else ""  # (result, workspace)
    else:
        return 0.0
    lhs = mod.by_name.get(ins.operands[0]) if ins.operands else None
    lhs_dims = dims_of(lhs.shape) if lhs else []
    k = math.prod(lhs_dims[d] for d in contracting if d < len(lhs_dims))
    return 2.0 * math.prod(dims_of(out_shape)) * k


def loop_dot_flops_uncounted(mod: Module) -> float:
    """FLOPs of the dots that run more often than once per step, beyond their first execution:
    what XLA's cost analysis (one pass through each loop body) leaves out."""
    mult = multipliers(mod)
    return sum((mult.get(ins.computation, 0) - 1) * dot_flops(ins, mod)
               for comp in mult for ins in mod.computations[comp] if mult[comp] > 1)



def gemm_kind(ins: Instr) -> str | None:
    """A cuBLAS custom call's target, "triton_gemm" for a Triton GEMM fusion, "dot"; None for the rest."""
    if ins.op == "custom-call" and (m := re.search(r'custom_call_target="([^"]*__cublas[^"]*)"', ins.attrs)):
        return m.group(1)
    if ins.op == "fusion" and "__triton_gemm" in ins.attrs:
        return "triton_gemm"
    return "dot" if ins.op == "dot" else None


def gemm_report(text: str) -> dict:
    """{"fp8": n, "bf16": n, "fp32": n, "other": n, "fp8_k_major": n, "fp8_not_k_major": n, "kinds": {...}}
    over every cuBLAS custom call, Triton GEMM fusion and dot of an HLO module (each where it is written,
    not times its computation's multiplier). An fp8 GEMM is K-major when each operand contracts exactly
    its minor-most dimension."""
    out = {"fp8": 0, "bf16": 0, "fp32": 0, "other": 0, "fp8_k_major": 0, "fp8_not_k_major": 0, "kinds": {}}
    mod = parse(text)
    for ins in (i for comp in mod.computations.values() for i in comp):
        kind = gemm_kind(ins)
        if kind is None:
            continue
        out["kinds"][kind] = out["kinds"].get(kind, 0) + 1
        ops = operand_types(ins, mod)[:2]
        dtypes = {d for d, _ in ops}
        if dtypes and all(d.startswith("f8") for d in dtypes):
            out["fp8"] += 1
            minor = [layout[0] if layout else None for _, layout in ops]
            k_major = len(ops) == 2 and contracting_dims(ins, "lhs") == [minor[0]] and \
                contracting_dims(ins, "rhs") == [minor[1]]
            out["fp8_k_major" if k_major else "fp8_not_k_major"] += 1
        elif "bf16" in dtypes:
            out["bf16"] += 1
        elif dtypes == {"f32"}:
            out["fp32"] += 1
        else:
            out["other"] += 1
    return out
