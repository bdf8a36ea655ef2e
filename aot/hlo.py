"""What a compiled program does, read from its optimized HLO text: collectives and matmuls.

    stats = collectives(compiled.as_text(), num_devices)  # {kind: {count, bytes, wire_bytes}}
    dots = matmul_dtypes(compiled.as_text())              # {"bf16": 180, "bf16+f32": 2}

Counts are static: an instruction inside a loop body (the decoder's while loop)
is counted once, not once per iteration. `bytes` is the size of each
collective's result per device; `wire_bytes` what a ring implementation sends
per device for it, from the replica-group size p: all-reduce 2(p-1)/p of the
data, all-gather and all-to-all (p-1)/p of their result, reduce-scatter (p-1)
times its result, a collective-permute its whole result.
"""

from __future__ import annotations

import math
import re
from typing import Any

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
_BYTES |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
# `%name = SHAPE opcode(` : SHAPE is an array or a (possibly nested) tuple of arrays.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")
_DONE_OPERAND = re.compile(r"-done\(\s*%([\w.\-]+)")


def array_bytes(shape: str) -> tuple[int, list[str]]:
    """Bytes of every array in an HLO shape string, and their element types."""
    total, dtypes = 0, []
    for dtype, dims in _ARRAY.findall(shape):
        size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
        total += int(math.prod(int(d) for d in dims.split(",") if d) * size)
        dtypes.append(dtype)
    return total, dtypes


def group_size(line: str, num_devices: int) -> int:
    """Devices per replica group of a collective instruction (all of them if not stated)."""
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", line)
    if m:
        return max(1, len([x for x in m.group(1).split(",") if x.strip()]))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota form: [groups, size]
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # named mesh axes
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        named = re.findall(r"'(\w+)'", m.group(2))
        return max(1, math.prod(int(sizes[a]) for a in named if a in sizes))
    m = re.search(r"source_target_pairs=\{([^}]*)\}", line)  # collective-permute
    if m:
        return 2
    return num_devices


def _wire(kind: str, size: int, p: int) -> float:
    if p <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (p - 1) / p * size
    if kind == "reduce-scatter":
        return float((p - 1) * size)
    if kind == "collective-permute":
        return float(size)
    return (p - 1) / p * size  # all-gather, all-to-all: of the full result


def collective_kind(opcode: str) -> str | None:
    """The collective an opcode is (one of KINDS; async -start/-done halves too), or None."""
    base = opcode.removesuffix("-start").removesuffix("-done")
    base = base.removeprefix("ragged-")
    return base if base in KINDS else None


def collectives(hlo: str, num_devices: int) -> dict[str, dict[str, Any]]:
    """{kind: {count, bytes, wire_bytes, dtypes}} over every collective instruction.

    Asynchronous pairs (`all-gather-start` / `all-gather-done`) count once, with
    the `-done` result's shape and the `-start`'s replica groups.
    """
    starts: dict[str, str] = {}
    out: dict[str, dict[str, Any]] = {}
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        kind = collective_kind(opcode)
        if kind is None:
            continue
        if opcode.endswith("-start"):
            starts[name] = line
            continue
        groups_line = line
        if opcode.endswith("-done"):
            operand = _DONE_OPERAND.search(line)
            groups_line = starts.get(operand.group(1), line) if operand else line
        size, dtypes = array_bytes(shape)
        p = group_size(groups_line, num_devices)
        entry = out.setdefault(kind, {"count": 0, "bytes": 0, "wire_bytes": 0.0, "dtypes": []})
        entry["count"] += 1
        entry["bytes"] += size
        entry["wire_bytes"] += _wire(kind, size, p)
        entry["dtypes"] = sorted(set(entry["dtypes"]) | set(dtypes))
    return out


def _is_matmul(opcode: str, line: str) -> bool:
    if opcode in ("dot", "convolution"):
        return True
    target = re.search(r'custom_call_target="([^"]*)"', line) if opcode == "custom-call" else None
    return bool(target) and ("gemm" in target.group(1) or "matmul" in target.group(1))


def matmul_dtypes(hlo: str) -> dict[str, int]:
    """{factor element types: count} of the matrix multiplies: dots and convolutions, and
    on GPUs the cuBLAS calls they become ("bf16": both factors bf16)."""
    shapes: dict[str, str] = {}
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        shapes[name] = shape
        if not _is_matmul(opcode, line):
            continue
        operands = re.findall(r"%([\w.\-]+)", line.split(f"{opcode}(", 1)[1].split(")", 1)[0])
        # The two factors; a cuBLAS call's third operand is the matrix it adds to (C).
        kinds = {array_bytes(shapes.get(o, ""))[1][0] for o in operands[:2] if shapes.get(o)}
        key = "+".join(sorted(kinds)) or array_bytes(shape)[1][0]
        out[key] = out.get(key, 0) + 1
    return out


def custom_calls(hlo: str, prefix: str) -> int:
    """How many custom calls target `prefix`... (e.g. '__cudnn' for cuDNN attention)."""
    return len(re.findall(r'custom_call_target="' + re.escape(prefix), hlo))
