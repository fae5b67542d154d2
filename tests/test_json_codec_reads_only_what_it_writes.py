"""The JSON codec: a frozen value's JSON from its types, read back strictly, every refusal one line with
its JSON path and the value found there."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import pytest

from cuda_allocator_model import MAX_BYTES
from pytest_gpumem.baselines.schema import BaselineError, dumps, loads
from pytest_gpumem.results.checks import OffShape
from pytest_gpumem.results.codec import BYTES, EMPTY, REPORT, SIGNED, STORED, Spec, decode, encode
from pytest_gpumem.results.explanation import Explanation, PhaseExplanation, SampledTimeline


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "GREEN"


@dataclass(frozen=True)
class Phase:
    peak_bytes: Annotated[int, BYTES]
    net_bytes: Annotated[int, SIGNED]
    rank: Annotated[int | None, Spec(omit=None, expected="a rank (0 or more)", low=0)] = None


@dataclass(frozen=True)
class Doc:
    name: Annotated[str, Spec(expected="a non-empty string", check=bool)]
    color: Color
    phases: Mapping[str, Phase]
    shape: tuple[int, ...] | None
    span: Annotated[tuple[int, int], Spec(expected="[first, last]")]
    ratio: float
    done: bool
    size: Annotated[int, Spec(key="bytes")]
    reserved: Annotated[int, BYTES] | None = None
    info: Any = None
    notes: Annotated[tuple[str, ...], Spec(omit=())] = ()
    tags: list[str] = field(default_factory=list)


DOC = Doc(
    name="t",
    color=Color.GREEN,
    phases={"forward": Phase(8, -4), "a-b": Phase(0, 0, rank=1)},
    shape=(2, 3),
    span=(0, 7),
    ratio=0.5,
    done=True,
    size=12,
    info={"free": [1, "form"]},
    tags=["x"],
)
JSON = {
    "name": "t",
    "color": "GREEN",
    "phases": {"forward": {"peak_bytes": 8, "net_bytes": -4}, "a-b": {"peak_bytes": 0, "net_bytes": 0, "rank": 1}},
    "shape": [2, 3],
    "span": [0, 7],
    "ratio": 0.5,
    "done": True,
    "bytes": 12,
    "reserved": None,
    "info": {"free": [1, "form"]},
    "tags": ["x"],
}


def test_a_value_is_written_as_its_fields_in_order_and_read_back_equal() -> None:
    written = encode(DOC)
    assert written == JSON
    assert list(written) == list(JSON)
    assert json.dumps(written)  # JSON types only: the enum's word, lists for tuples
    assert decode(Doc, json.loads(json.dumps(written)), "doc") == DOC


def test_an_omitted_value_is_read_back_from_its_absent_key() -> None:
    with_notes = decode(Doc, {**JSON, "notes": ["n"]}, "doc")
    assert with_notes.notes == ("n",)
    assert encode(with_notes)["notes"] == ["n"]
    assert "notes" not in encode(DOC)


def _changed(path: tuple[str, ...], value: object) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(JSON))
    *parents, last = path
    node: dict[str, Any] = doc
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("name",), KeyError, 'doc has no "name"'),
        (("extra",), 1, 'doc has an unknown key "extra"'),
        (("name",), "", "doc.name must be a non-empty string, got ''"),
        (("color",), "green", "doc.color must be one of red, GREEN, got 'green'"),
        (
            ("phases", "forward", "peak_bytes"),
            "8",
            "doc.phases.forward.peak_bytes must be an integer of bytes, got '8'",
        ),
        (("phases", "forward", "peak_bytes"), -1, "doc.phases.forward.peak_bytes must be an integer of bytes, got -1"),
        (
            ("phases", "forward", "peak_bytes"),
            MAX_BYTES + 1,
            f"doc.phases.forward.peak_bytes must be an integer of bytes, got {MAX_BYTES + 1}",
        ),
        (
            ("phases", "forward", "peak_bytes"),
            True,
            "doc.phases.forward.peak_bytes must be an integer of bytes, got True",
        ),
        (
            ("phases", "forward", "net_bytes"),
            1.0,
            "doc.phases.forward.net_bytes must be an integer of bytes (negative where freed), got 1.0",
        ),
        (("phases", "a-b", "rank"), -1, 'doc.phases["a-b"].rank must be a rank (0 or more), got -1'),
        (("phases", "a-b", "count"), 1, 'doc.phases["a-b"] has an unknown key "count"'),
        (("phases",), [], "doc.phases must be an object, got []"),
        (("shape",), [2, "3"], "doc.shape[1] must be an integer, got '3'"),
        (("shape",), 6, "doc.shape must be a list or null, got 6"),
        (("span",), [0, 1, 2], "doc.span must be [first, last], got [0, 1, 2]"),
        (("ratio",), "0.5", "doc.ratio must be a number, got '0.5'"),
        (("done",), 1, "doc.done must be true or false, got 1"),
        (("bytes",), KeyError, 'doc has no "bytes"'),
        (("reserved",), "x", "doc.reserved must be an integer of bytes or null, got 'x'"),
        (("tags",), ["x", None], "doc.tags[1] must be a string, got None"),
    ],
)
def test_a_value_not_as_written_is_refused_at_its_json_path(path: tuple[str, ...], value: object, message: str) -> None:
    with pytest.raises(OffShape) as refused:
        decode(Doc, _changed(path, value), "doc")
    assert str(refused.value) == message


def test_a_null_where_the_writer_leaves_the_key_out_is_refused_at_its_key() -> None:
    with pytest.raises(OffShape) as refused:
        decode(Doc, _changed(("phases", "forward", "rank"), None), "doc")
    assert str(refused.value) == "doc.phases.forward.rank must be a rank (0 or more), got None"


def test_a_value_read_that_would_be_written_otherwise_is_refused_by_the_round_trip() -> None:
    with pytest.raises(OffShape, match=r"^doc is not as pytest-gpumem writes it, got \{"):
        decode(Doc, {**JSON, "notes": []}, "doc")


def test_an_integer_read_where_a_number_goes_is_written_back_an_integer() -> None:
    read = decode(Doc, {**JSON, "ratio": 2}, "doc")
    assert read.ratio == 2 and type(encode(read)["ratio"]) is int


@dataclass(frozen=True)
class Stored:
    device: Annotated[str, Spec(expected="a non-empty string", check=bool)]
    phases: Annotated[
        Mapping[str, Annotated[int, Spec(expected="an integer 0 <= n < 2**63 (bytes)", low=0, high=MAX_BYTES)]],
        Spec(
            expected="an object of phase name -> bytes",
            names=bool,
            names_expected="phase names must be non-empty strings",
        ),
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "expected an object, got []"),
        ({"phases": {}}, "missing key 'device'"),
        ({"device": "d", "phases": {}, "x": 1}, "unknown key 'x'"),
        ({"device": "", "phases": {}}, "device: expected a non-empty string, got ''"),
        ({"device": "d", "phases": 3}, "phases: expected an object of phase name -> bytes, got 3"),
        ({"device": "d", "phases": {"": 1}}, "phases: phase names must be non-empty strings, got ''"),
        ({"device": "d", "phases": {"f": -1}}, 'phases["f"]: expected an integer 0 <= n < 2**63 (bytes), got -1'),
    ],
)
def test_a_stored_value_says_what_is_wrong_in_the_baseline_files_words(data: object, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        decode(Stored, data, "", STORED)
    assert str(refused.value) == message


def test_the_two_wordings_name_a_nested_key_each_their_way() -> None:
    assert str(STORED.no_key("identity", "device")) == "identity: missing key 'device'"
    assert str(REPORT.no_key("tests[0]", "status")) == 'tests[0] has no "status"'
    assert STORED.member("phases", "forward") == 'phases["forward"]'
    assert REPORT.member("phases", "forward") == "phases.forward"


@dataclass(frozen=True)
class Ordered:
    __json_keys__ = ("version", "name", "items")

    name: str
    items: Annotated[list[int], Spec(omit=EMPTY)] = field(default_factory=list)
    version: int = 1


def test_keys_come_in_the_order_a_class_names_and_an_empty_list_is_left_out() -> None:
    assert list(encode(Ordered("n", [1]))) == ["version", "name", "items"]
    assert encode(Ordered("n")) == {"version": 1, "name": "n"}
    assert decode(Ordered, {"version": 1, "name": "n"}, "o") == Ordered("n")


def test_a_stored_file_is_written_back_byte_for_byte_its_integers_floats_and_nan_as_they_were() -> None:
    stats = {"l1": 1, "l2": 1.0, "max_abs": "nan", "proj": [0, -0.0, "inf"], "sum": 2.5}
    entry = {
        "composition": {"forward": {"categories": {"saved": -1}, "cells": [["saved", "h.*", 1]]}},
        "cuda": None,
        "gradients": {"method": "m", "params": {"w": {"dtype": "float32", "grad": stats, "shape": [2]}}},
        "identity": {"backend": "tracker", "capability": None, "device": "cpu", "total_memory": None},
        "peak_bytes": 8,
        "phases": {"forward": 8},
        "torch": "2.13.0",
    }
    document = {"entries": {"t.py::t": {"tracker | cpu": entry}}, "schema": "pytest-gpumem-baselines", "version": 1}
    text = json.dumps(document, indent=2, sort_keys=True) + "\n"
    assert dumps(loads(text)) == text
    with pytest.raises(BaselineError, match=r'composition\["forward"\]\.folded: expected an object of .*, got None$'):
        loads(text.replace('"cells"', '"folded": null, "cells"'))


RELEASED_PHASE = {  # a phase as 0.1.0 explained it: no groups (folding came later), no reserved_at_peak
    "categories": {"saved": 8},
    "live": {"saved": 8},
    "modules": {"fc": 8},
    "cells": [{"category": "saved", "module": "fc", "bytes": 8}],
    "tensors": [
        {"bytes": 8, "dtype": "float32", "shape": [2], "op": "aten.relu.default", "where": "t.py:3", "module": "fc",
         "category": "saved"}
    ],
    "peak_bytes": 8,
    "start_bytes": 0,
    "peak_index": 1,
    "spans": [[0, 2]],
    "entries": 1,
    "unattributed_bytes": 0,
}  # fmt: skip


def test_an_explanation_as_the_released_version_wrote_it_reads_back() -> None:
    released = {
        "format": "pytest-gpumem explanation 1",
        "nodeid": "t.py::t",
        "backend": "tracker",
        "categories": ["saved"],
        "labels": {"saved": "saved for backward"},
        "phases": {"call": RELEASED_PHASE},
        "timeline": {"events": 2, "points": [[0, [0]], [1, [8]], [2, [0]]]},
    }  # no folded, and no unmeasured spans in the timeline
    explanation = Explanation.from_json(released)
    assert explanation.folded is None and explanation.timeline.unmeasured == []
    assert explanation.phases["call"].groups is None and explanation.phases["call"].live == {"saved": 8}
    assert explanation.to_json() == released


def test_an_explanation_without_a_key_every_version_wrote_is_refused_naming_it() -> None:
    call = PhaseExplanation(8, {"saved": 8}, {}, [], [], live={"saved": 8}, entries=1)
    written = Explanation("t.py::t", "tracker", [], {}, {"call": call}, SampledTimeline(0, [])).to_json()
    assert Explanation.from_json(written).phases["call"] == call
    with pytest.raises(OffShape, match=r'^explanation has no "format"$'):
        Explanation.from_json({key: value for key, value in written.items() if key != "format"})
    phase = written["phases"]["call"]
    for key in ("live", "entries"):
        bare = {**written, "phases": {"call": {k: v for k, v in phase.items() if k != key}}}
        with pytest.raises(OffShape, match=rf'^explanation\.phases\.call has no "{key}"$'):
            Explanation.from_json(bare)


def _total(row: Row) -> int:
    return sum(row.sizes)


if TYPE_CHECKING:
    Late = Phase


def _late() -> dict[str, Any]:
    return {"Late": Phase}  # a type the annotations name that the module imports only when it reads


@dataclass(frozen=True)
class Row:
    __json_keys__ = ("label", "total", "sizes", "phase")
    __json_derived__ = ("total",)
    __json_names__ = staticmethod(_late)

    label: Annotated[str, Spec(outside=True, absent=lambda: "unread")]
    sizes: Sequence[int]
    phase: Late | None = None

    @property
    def total(self) -> int:
        return _total(self)


def test_a_field_outside_the_json_is_not_written_and_a_derived_key_is_read_by_the_round_trip() -> None:
    written = encode(Row("kept by its reader", [3, 4], Phase(8, -4)))
    assert written == {"total": 7, "sizes": [3, 4], "phase": {"peak_bytes": 8, "net_bytes": -4}}
    assert list(written) == ["total", "sizes", "phase"]
    assert decode(Row, written, "row") == Row("unread", (3, 4), Phase(8, -4))  # a sequence read as a tuple
    with pytest.raises(OffShape) as refused:
        decode(Row, {**written, "total": 8}, "row")
    assert str(refused.value) == "row.total is not as pytest-gpumem writes it, got 8"
    with pytest.raises(OffShape) as refused:
        decode(Row, {"sizes": [3]}, "row")
    assert str(refused.value) == 'row has no "total"'
