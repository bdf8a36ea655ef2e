"""A step-time estimate that sums a roofline per kernel of a compiled GPU program.

    est = kernel_roofline(compiled.as_text(), peak_flops=989e12, hbm_bandwidth=3.35e12)
    est["seconds"], est["gemm_s"], est["attention_s"], est["memory_s"], est["kernels"]

Each kernel the program launches (a cuBLAS GEMM, a cuDNN attention call, an XLA
fusion, a copy) takes max(its FLOPs / peak, its bytes / HBM bandwidth), and the
step takes their sum: kernels run one after another on one stream. The sum of
maxima is what the single roofline max(all FLOPs / peak, all bytes / bandwidth)
misses: a transformer step alternates compute-bound GEMMs with memory-bound
LayerNorm, dropout, softmax and loss fusions, and neither overlaps the other,
so the single roofline underestimates a step several-fold and the sum much less
(the measurements: docs/PERFORMANCE.md).

FLOPs: GEMMs 2 x output elements x contracted size (from the custom call's
dimension numbers); cuDNN attention 4 B N T S H forward (half of it under a
causal mask), 2.5 times that backward (five products instead of two); fusions
none (their arithmetic hides under their memory traffic). Bytes: every operand
and result, except that a fusion reading a parameter only through
(dynamic-)slices reads the slices, and an in-place dynamic-update-slice writes
only its update. A while loop with a known trip count counts its body that many
times (an unknown count: once); a conditional counts every branch. Collectives
are left to the caller (they run on their own streams).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from attention_jax.aot.hlo import array_bytes, collective_kind

_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\(([^)]*)\)(.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_DIMS = re.compile(r"\[([\d,]*)\]")
# Opcodes that launch nothing: views, tuples, constants, scheduling markers.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "opt-barrier", "add-dependency", "partition-id", "replica-id", "domain"}  # fmt: skip


@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses (a parameter's number)
    attrs: str
    root: bool


@dataclass
class _Module:
    computations: dict[str, list[_Instr]] = field(default_factory=dict)
    shapes: dict[str, str] = field(default_factory=dict)
    entry: str = ""


def _parse(hlo: str) -> _Module:
    module, current = _Module(), None
    for line in hlo.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(1)
                module.computations[current] = []
                if line.startswith("ENTRY"):
                    module.entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            root, name, shape, opcode, operands, attrs = m.groups()
            instr = _Instr(
                name, shape, opcode, _NAME.findall(operands), operands, attrs, bool(root)
            )
            module.computations[current].append(instr)
            module.shapes[name] = shape
    return module


def _dims(shape: str) -> list[int]:
    """Dimensions of the first array in an HLO shape."""
    m = _DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _array_bytes(shape: str) -> int:
    return int(array_bytes(shape)[0])


def _gemm_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    out = math.prod(_dims(instr.shape))
    lhs = _dims(shapes.get(instr.operands[0], ""))
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    contracted = [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip()] if m else []
    return 2.0 * out * math.prod(lhs[d] for d in contracted if d < len(lhs))


def _attention_flops(instr: _Instr, shapes: dict[str, str], backward: bool) -> float:
    q, k = (_dims(shapes.get(name, "")) for name in instr.operands[:2])
    if len(q) != 4 or len(k) != 4:
        return 0.0
    b, t, n, h = q  # cuDNN's operands are [B, T, N, H] (operand_layout_constraints)
    flops = 4.0 * b * n * t * k[1] * h
    if "CAUSAL" in instr.attrs:
        flops /= 2
    return flops * (2.5 if backward else 1.0)


def _fusion_bytes(instr: _Instr, module: _Module) -> int:
    """Bytes a fusion moves: operands as its body reads them, plus what it writes."""
    m = re.search(r"calls=%([\w.\-]+)", instr.attrs)
    body = module.computations.get(m.group(1), []) if m else []
    params = {i.name: int(i.args) for i in body if i.opcode == "parameter" and i.args.isdigit()}
    users: dict[str, list[_Instr]] = {}
    for i in body:
        for op in i.operands:
            users.setdefault(op, []).append(i)
    read = {}
    for pname, index in params.items():
        uses = users.get(pname, [])
        sliced = [u.opcode in ("dynamic-slice", "slice") and u.operands[0] == pname for u in uses]
        if uses and all(sliced):  # the array sliced, not an index
            read[index] = sum(_array_bytes(u.shape) for u in uses)
    written = _array_bytes(instr.shape)
    root = next((i for i in body if i.root), None)
    if root is not None and root.opcode == "dynamic-update-slice" and root.operands:
        target = root.operands[0]
        if target in params:  # in place: the untouched part is neither read nor written
            update = _array_bytes(module.shapes.get(root.operands[1], ""))
            read[params[target]] = 0
            written = update
    total = written
    for index, name in enumerate(instr.operands):
        total += read.get(index, _array_bytes(module.shapes.get(name, "")))
    return total


@dataclass(frozen=True)
class Kernel:
    """One launch: what it is, its FLOPs and bytes, its roofline seconds, how often it runs."""

    name: str
    kind: str  # "gemm", "attention", "memory"
    flops: float
    bytes: int
    seconds: float
    count: int


def _kernels(module: _Module, computation: str, count: int, peak: float, bw: float, out: list):
    """Append to `out` the kernels `computation` launches, each run `count` times."""
    for instr in module.computations.get(computation, []):
        op = instr.opcode
        if op in _FREE or collective_kind(op):
            continue
        if op == "while":
            body = re.search(r"body=%([\w.\-]+)", instr.attrs)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
            n = int(trips.group(1)) if trips else 1
            if body:
                _kernels(module, body.group(1), count * n, peak, bw, out)
            continue
        if op in ("call", "conditional"):
            for called in re.findall(
                r"(?:to_apply|calls|branch_computations)=\{?%([\w.\-]+)", instr.attrs
            ):
                _kernels(module, called, count, peak, bw, out)
            continue
        flops, kind = 0.0, "memory"
        target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
        if op == "custom-call" and target and target.group(1).startswith("__cublas"):
            flops, kind = _gemm_flops(instr, module.shapes), "gemm"
        elif op == "custom-call" and target and target.group(1).startswith("__cudnn$fmha"):
            backward = "Backward" in target.group(1)
            flops, kind = _attention_flops(instr, module.shapes, backward), "attention"
        if op == "fusion":
            nbytes = _fusion_bytes(instr, module)
        else:  # a GEMM's workspace (s8) is scratch, not traffic
            shape = re.sub(r"s8\[\d+\]\{0\}", "", instr.shape)
            nbytes = _array_bytes(shape) + sum(
                _array_bytes(module.shapes.get(o, "")) for o in instr.operands
            )
        seconds = max(flops / peak, nbytes / bw)
        out.append(Kernel(instr.name, kind, flops, nbytes, seconds, count))


def kernel_roofline(hlo: str, peak_flops: float, hbm_bandwidth: float) -> dict[str, Any]:
    """The per-kernel roofline of an optimized GPU HLO module (see the module docstring).

    Returns seconds (the sum), the seconds of GEMMs, attention and memory-bound
    kernels, the kernel launches per step, and the FLOPs and bytes summed.
    """
    module = _parse(hlo)
    kernels: list[Kernel] = []
    _kernels(module, module.entry, 1, peak_flops, hbm_bandwidth, kernels)
    by_kind = {
        k: sum(x.seconds * x.count for x in kernels if x.kind == k)
        for k in ("gemm", "attention", "memory")
    }
    return {
        "seconds": sum(by_kind.values()),
        "gemm_s": by_kind["gemm"],
        "attention_s": by_kind["attention"],
        "memory_s": by_kind["memory"],
        "kernels": sum(x.count for x in kernels),
        "flops": sum(x.flops * x.count for x in kernels),
        "bytes": sum(x.bytes * x.count for x in kernels),
    }
