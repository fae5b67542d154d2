"""A pickle's opcodes checked before the C unpickler runs them, so that a file from someone else's machine is
data and never a crash: the scan ends at the pickle's STOP (nothing after it is read), every length must lie
within the file, a memo index within what came before it, and hashing cannot recurse deeply.

The bound on hashing: the C unpickler hashes every dict key and set item, and a tuple's hash recurses into
its items without a recursion limit (a 1,000,000-deep tuple key overflows the C stack). A tuple of scalars
(torch's `segment_pool_id` and `pool_id`, `(0, 0)`) is safe and is not counted; every other tuple or
frozenset is, and a pickle may build at most `MAX_TUPLES` of them, so that no tuple is deeper than that.

Opcodes that make objects other than plain data (REDUCE, BUILD, NEWOBJ, persistent ids, out-of-band
buffers) are refused here; one that names a global ends the scan there, so that the unpickler's own
refusal names it. The documented limit: a pickle of at most `LIMIT` bytes (1 GiB, some 3 million events
with deep stacks) is read; memory then stays within a small multiple of that.
"""

from __future__ import annotations

import mmap
import re
import struct
import sys
from typing import Final, TypeAlias

__all__ = ["LIMIT", "MAX_TUPLES", "Buffer", "Refused", "extent"]

Buffer: TypeAlias = "bytes | mmap.mmap"

LIMIT: Final = 1 << 30
MAX_TUPLES: Final = 10_000


class Refused(Exception):
    """Why the bytes are not a plain-data pickle (one line, without the file's name)."""


_LONG1 = b"\\x8a(?:" + b"|".join(re.escape(bytes([n])) + b".{%d}" % n for n in range(9)) + b")"
_SCALAR = b"(?:K.|M..|J....|" + _LONG1 + b"|[N\\x88\\x89]|G.{8})"
_SHORT_TEXT = b"\\x8c(?:" + b"|".join(re.escape(bytes([n])) + b".{%d}" % n for n in range(256)) + b")"
_OP = (  # the opcodes that are safe whatever their context, the most frequent first
    b"[hK].|j....|[(}u\\x94\\])esaN\\x88\\x89012dl\\x8f]|J....|M..|"
    + _LONG1
    + b"|[q\\x80].|[\\x95G].{8}|"
    + _SHORT_TEXT
)
# A run is matched `_CHUNK` opcodes at a time, so that the check of a TUPLE1-3's items rereads the run's last
# two chunks at most, from where an opcode starts: a greedy repeat (`*`) keeps a frame for each opcode it
# matched (some 140 bytes: a whole 10 MB run took 1.2 GB), and Python 3.10 has no possessive one (`*+`).
_CHUNK: Final = 4096
_POSSESSIVE: Final = b"+" if sys.version_info >= (3, 11) else b""
_BULK: Final = re.compile(b"(?:" + _OP + b"){0,%d}" % _CHUNK + _POSSESSIVE, re.DOTALL)
# A run of safe opcodes whose last `n` push scalars: the items of a TUPLEn that follows, which hash flat.
_ENDS_IN_SCALARS: Final = {n: re.compile(b"(?:" + _OP + b")*" + _SCALAR + b"{%d}" % n, re.DOTALL) for n in (1, 2, 3)}
_TUPLE_N: Final = {0x85: 1, 0x86: 2, 0x87: 3}
_TUPLES: Final = frozenset(b"t\x85\x86\x87\x90\x91")  # TUPLE, TUPLE1-3, ADDITEMS, FROZENSET
_SIZED: Final = {  # opcode: (bytes of its length, struct format of the length)
    ord("X"): (4, "<I"), ord("B"): (4, "<I"), ord("T"): (4, "<i"), ord("U"): (1, "<B"), ord("C"): (1, "<B"),
    0x8C: (1, "<B"), 0x8D: (8, "<Q"), 0x8E: (8, "<Q"), 0x8B: (4, "<i"), 0x8A: (1, "<B"),
}  # fmt: skip
_LINES: Final = frozenset(b"ILFSVg")  # a text argument up to a newline
_GLOBALS: Final = frozenset(b"ci\x93\x82\x83\x84")  # GLOBAL, INST, STACK_GLOBAL, EXT1/2/4
_EXTENSION: Final = {0x82: 1, 0x83: 2, 0x84: 4}
_NAMES: Final = {
    ord("R"): "REDUCE", ord("b"): "BUILD", ord("o"): "OBJ", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX",
    ord("P"): "PERSID", ord("Q"): "BINPERSID", 0x96: "BYTEARRAY8", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}  # fmt: skip


def extent(data: Buffer) -> int:
    """The length of the pickle at the start of `data` (its STOP included), once every opcode up to it is
    checked; or, where an opcode names a global, the length up to it (the unpickler refuses it, naming it).
    Raises `Refused` for anything else."""
    end = min(len(data), LIMIT)
    pos = tuples = 0
    while True:
        pos, tail = _safe_run(data, pos, end)
        if pos >= end:
            if end < len(data):
                raise Refused(f"no end of the pickle in its first {LIMIT >> 30} GiB (the most a snapshot may be)")
            raise Refused(f"a pickle cut short after {len(data)} bytes (truncated)")
        op = data[pos]
        if op == 0x2E:  # STOP
            return pos + 1
        if op in _TUPLES:
            n = _TUPLE_N.get(op)
            flat = n is not None and _ENDS_IN_SCALARS[n].fullmatch(data, tail, pos) is not None
            tuples += not flat
            if tuples > MAX_TUPLES:
                raise Refused(f"a pickle of more than {MAX_TUPLES:,} nested tuples or sets: no snapshot's shape")
            pos += 1
        elif op in _SIZED:
            pos = _sized(data, pos, end, op)
        elif op == ord("r"):  # LONG_BINPUT
            pos = _put(data, pos, end, struct.unpack_from("<I", data, pos + 1)[0] if pos + 5 <= end else 0, 5)
        elif op == ord("p"):  # PUT, as text
            stop = _line_end(data, pos, end)
            digits = bytes(data[pos + 1 : stop]).strip()
            pos = _put(data, pos, end, int(digits) if digits.isdigit() and len(digits) < 19 else 1 << 62, 0, stop)
        elif op in _LINES:
            pos = _line_end(data, pos, end) + 1
        elif op in _GLOBALS:
            return _global_end(data, pos, end, op)
        else:
            name = _NAMES.get(op)
            found = f"the opcode {name}" if name else f"the byte 0x{op:02x}, no opcode"
            raise Refused(f"not a pickle of plain data ({found} at byte {pos})")


def _safe_run(data: Buffer, pos: int, end: int) -> tuple[int, int]:
    """The end of the run of opcodes safe in any context that starts at `pos`, and where its last two chunks
    start (an opcode's start: the run's own start, or 3 opcodes at least before its end)."""
    tail = pos
    while True:
        after: int = _BULK.match(data, pos, end).end()  # type: ignore[union-attr]
        if after - pos < _CHUNK:  # fewer opcodes than a chunk holds (each is a byte at least): the run's end
            return after, tail
        tail, pos = pos, after  # a chunk of CHUNK bytes holds 16 opcodes at least (each is 257 bytes at most)


def _sized(data: Buffer, pos: int, end: int, op: int) -> int:
    width, fmt = _SIZED[op]
    if pos + 1 + width > end:
        raise Refused(f"a pickle cut short after {end} bytes (truncated)")
    length: int = struct.unpack_from(fmt, data, pos + 1)[0]
    after = pos + 1 + width + length
    if length < 0 or after > end:
        shown = f"{length:,}" if length < 1 << 64 else "more"
        raise Refused(f"a pickle cut short after {end} bytes (truncated: {shown} bytes asked at byte {pos})")
    return after


def _put(data: Buffer, pos: int, end: int, index: int, width: int, stop: int = 0) -> int:
    """Past a memo store of `index`: no pickle stores more objects than it has bytes before the store."""
    if width and pos + width > end:
        raise Refused(f"a pickle cut short after {end} bytes (truncated)")
    if index > pos:
        raise Refused(f"a memo index of {index:,} at byte {pos}, more than the objects before it")
    return pos + width if width else stop + 1


def _line_end(data: Buffer, pos: int, end: int) -> int:
    stop = data.find(b"\n", pos, end)
    if stop < 0:
        raise Refused(f"a pickle cut short after {end} bytes (truncated)")
    return stop


def _global_end(data: Buffer, pos: int, end: int, op: int) -> int:
    """Where the scan ends at an opcode naming a global: GLOBAL and INST are refused here, naming it; for
    STACK_GLOBAL and EXT the unpickler asks `find_class`, which refuses."""
    if op in b"ci":
        first = _line_end(data, pos, end)
        second = _line_end(data, first + 1, end)
        module = bytes(data[pos + 1 : first]).decode("ascii", "backslashreplace")
        name = bytes(data[first + 1 : second]).decode("ascii", "backslashreplace")
        shown = f"{module}.{name}"[:80]
        raise Refused(f"a pickle that names the global {shown}: refused (a snapshot holds plain data only)")
    return _frame_end(data, min(pos + 1 + _EXTENSION.get(op, 0), end), end)


def _frame_end(data: Buffer, pos: int, end: int) -> int:
    """The end of the FRAME (protocol 4) holding `pos`, which the unpickler reads whole; `pos` without frames."""
    at = 2 if data[:1] == b"\x80" else 0
    while at + 9 <= end and data[at] == 0x95:
        after: int = at + 9 + struct.unpack_from("<Q", data, at + 1)[0]
        if after >= pos:
            return min(after, end)
        at = after
    return pos
