"""Two request sequences aligned on their sizes, in time linear in their length where they differ in few
places: the common start and end are taken off, and the middle is aligned by Myers' shortest edit script
(O((N + M) D) for D differences), whose runs of equal requests are found by comparing slices in C. Where the
middle differs in more than `MAX_EDITS` places, it is one run that differs (`Aligned.cut` says so), so
that no pair of files can make the comparison quadratic.

The runs are difflib's opcodes: ('equal' | 'replace' | 'delete' | 'insert', i1, i2, j1, j2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_EDITS", "Aligned", "align"]

MAX_EDITS: Final = 400
Opcode = tuple[str, int, int, int, int]


@dataclass(frozen=True)
class Aligned:
    opcodes: tuple[Opcode, ...]
    matched: int  # elements of the first sequence matched in the second, in order
    cut: bool  # the middle differed in more than MAX_EDITS places: it is one run


def align(first: Sequence[int], second: Sequence[int], max_edits: int = MAX_EDITS) -> Aligned:
    """The runs where `first` and `second` agree and differ, and how many elements agree."""
    codes: dict[int, str] = {}
    a = "".join(codes.setdefault(x, chr(len(codes))) for x in first)  # one character per distinct size
    b = "".join(codes.setdefault(x, chr(len(codes))) for x in second)
    start = _common(a, b, 0, 0)
    end = 0
    while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1  # the common tail (short in practice: the loop stops at the first difference from the end)
    middle_a, middle_b = a[start : len(a) - end], b[start : len(b) - end]
    path = _myers(middle_a, middle_b, max_edits)
    cut = path is None
    steps = [("equal", start, start)] if start else []
    if path is None:
        steps.append(("replace", len(middle_a), len(middle_b)))
    else:
        steps += path
    if end:
        steps.append(("equal", end, end))
    opcodes = _slid(_opcodes(steps), a, b)
    matched = sum(i2 - i1 for tag, i1, i2, _, _ in opcodes if tag == "equal")
    return Aligned(tuple(opcodes), matched, cut)


def _common(a: str, b: str, x: int, y: int) -> int:
    """The length of the common prefix of a[x:] and b[y:], by galloping slice comparisons."""
    n = min(len(a) - x, len(b) - y)
    done, step = 0, 1
    while done < n:
        step = min(step, n - done)
        if a[x + done : x + done + step] == b[y + done : y + done + step]:
            done += step
            step *= 2
            continue
        low, high = done, done + step  # the first difference lies in [low, high)
        while high - low > 1:
            mid = (low + high) // 2
            if a[x + low : x + mid] == b[y + low : y + mid]:
                low = mid
            else:
                high = mid
        return low
    return done


def _myers(a: str, b: str, max_edits: int) -> list[tuple[str, int, int]] | None:
    """The shortest edit script from `a` to `b` as steps (kind, length in a, length in b); None past
    `max_edits` edits."""
    n, m = len(a), len(b)
    offset = max_edits + 1
    v = [0] * (2 * offset + 1)
    history: list[list[int]] = []
    for d in range(max_edits + 1):
        history.append(v[offset - d - 1 : offset + d + 2])
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[offset + k - 1] < v[offset + k + 1]):
                x = v[offset + k + 1]
            else:
                x = v[offset + k - 1] + 1
            y = x - k
            if x <= n and 0 <= y <= m:
                x += _common(a, b, x, y)
            v[offset + k] = x
            if x == n and x - k == m:  # a point past the grid's edge only moves further away
                return _walk_back(history, d, k, n, m)
    return None


def _walk_back(history: list[list[int]], d: int, k: int, n: int, m: int) -> list[tuple[str, int, int]]:
    """The steps of the path that reached (n, m) on diagonal `k` after `d` edits, first to last."""
    steps: list[tuple[str, int, int]] = []
    x = n
    for e in range(d, 0, -1):
        row = history[e]  # v[-e-1 .. e+1] before round e, at index (k + e + 1)
        down = k == -e or (k != e and row[k - 1 + e + 1] < row[k + 1 + e + 1])
        previous = k + 1 if down else k - 1
        start_x = row[previous + e + 1]
        mid_x = start_x if down else start_x + 1  # after the edit, before the run of equal elements
        if x > mid_x:
            steps.append(("equal", x - mid_x, x - mid_x))
        steps.append(("insert", 0, 1) if down else ("delete", 1, 0))
        x, k = start_x, previous
    if x > 0:
        steps.append(("equal", x, x))
    steps.reverse()
    return steps


def _opcodes(steps: list[tuple[str, int, int]]) -> list[Opcode]:
    """Steps merged into runs: equal runs joined, neighbouring deletes and inserts one 'replace' run."""
    out: list[Opcode] = []
    i = j = 0
    for kind, da, db in steps:
        if not da and not db:
            continue
        if out and (out[-1][0] == "equal") == (kind == "equal"):
            _, i1, _, j1, _ = out[-1]
            out[-1] = (_tag(kind, i + da - i1, j + db - j1), i1, i + da, j1, j + db)
        else:
            out.append((_tag(kind, da, db), i, i + da, j, j + db))
        i, j = i + da, j + db
    return out


def _tag(kind: str, in_a: int, in_b: int) -> str:
    if kind == "equal":
        return kind
    return "replace" if in_a and in_b else "delete" if in_a else "insert"


def _slid(opcodes: list[Opcode], a: str, b: str) -> list[Opcode]:
    """An insertion, a run of equal elements, then a deletion (or the other way) is one replacement beside
    the run wherever the run repeats what moves past it: equal sizes leave Myers' path a choice."""
    out: list[Opcode] = []
    i = 0
    while i < len(opcodes):
        window = opcodes[i : i + 3]
        if len(window) == 3 and window[1][0] == "equal" and {window[0][0], window[2][0]} == {"insert", "delete"}:
            moved = _slide(window[0], window[1], window[2], a, b)
            if moved is not None:
                out += moved
                i += 3
                continue
        out.append(opcodes[i])
        i += 1
    return out


def _slide(first: Opcode, same: Opcode, last: Opcode, a: str, b: str) -> list[Opcode] | None:
    _, i1, i2, j1, j2 = first
    _, _, i3, _, j3 = same
    _, _, i4, _, j4 = last
    run, last_a, last_b = i3 - i2, i4 - i3, j4 - j3
    if (a[i2:i3] == a[i2 + last_a : i4]) if last_a else (b[j2:j3] == b[j2 + last_b : j4]):  # last moves left
        ends = (i2 + last_a, j2 + last_b)
        return [(_tag("x", ends[0] - i1, ends[1] - j1), i1, ends[0], j1, ends[1]), ("equal", ends[0], i4, ends[1], j4)]
    if (a[i1 : i1 + run] == a[i2:i3]) if i2 > i1 else (b[j1 : j1 + run] == b[j2:j3]):  # first moves right
        return [
            ("equal", i1, i1 + run, j1, j1 + run),
            (_tag("x", i4 - i1 - run, j4 - j1 - run), i1 + run, i4, j1 + run, j4),
        ]
    return None
