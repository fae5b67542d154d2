"""The max_memory marker: limits on each side of a measured peak, markers on several levels, and every
bad argument (read by `budget_from_marker`; one run shows how a bad marker fails its test)."""

from __future__ import annotations

import inspect
import json
from fnmatch import fnmatchcase
from typing import Any

import pytest
from builders import Reported, assert_one_line_failure

from pytest_gpumem import Budget, GpuMemError, budget_from_marker
from pytest_gpumem.marker import max_memory

# forward peak of torch.sum(x * y) on N float32: the product (4N) and the sum (4): 4004 bytes for N = 1000;
# backward: the seed (4) and grad * y (4000)
PHASE_LIMITS = """
import pytest, torch

N = 1000

def step(gpumem):
    x = torch.randn(N, requires_grad=True)
    y = torch.randn(N)
    with gpumem.phase("forward"):
        loss = torch.sum(x * y)
    with gpumem.phase("backward"):
        loss.backward()

LIMITS = [4004, "4004 B", "4.004 kB", 4003, "4.003kB"]

@pytest.mark.parametrize(
    "limit", [pytest.param(n, marks=pytest.mark.max_memory(forward=n), id=str(n)) for n in LIMITS]
)
def test_edge(gpumem, limit):
    step(gpumem)

@pytest.mark.max_memory(forward='1 MB', backward='2 kB')
def test_over(gpumem):
    step(gpumem)

@pytest.mark.max_memory(forwrd='1 MB')
def test_unopened(gpumem):
    step(gpumem)

@pytest.mark.max_memory("1 MB", tolerance="7.5%")
def test_tolerance_alone_passes():
    pass

@pytest.mark.max_memory(forward="1 MB", tolerance=0)
def test_zero_tolerance_passes(gpumem):
    step(gpumem)
"""


def test_phase_limits_hold_to_the_byte_and_a_failure_names_phase_limit_and_breakdown(
    tracker: pytest.Pytester,
) -> None:
    tracker.makepyfile(PHASE_LIMITS)
    result = tracker.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=5, failed=4)
    result.stdout.fnmatch_lines(
        [
            "*_ test_edge[[]4003[]] _*",
            "forward peak 3.9 KiB (4,004 B) exceeds max_memory forward=4003 B*",
            "*_ test_edge[[]4.003kB[]] _*",
            "forward peak 4.0 kB (4,004 B) exceeds max_memory forward=4.003kB*",
            "*_ test_over _*",
            "backward peak 4.0 kB exceeds max_memory backward=2 kB (see what made it with --gpumem-explain)",
            "*Captured gpumem call*",
            "also: see what made it with --gpumem-explain or max_memory(explain=True)",  # 121 columns on the line
            "forward: peak 3.9 KiB (requested 3.9 KiB), net 4 B, entered 1x",
            "backward: peak 3.9 KiB (requested 3.9 KiB), net 3.9 KiB, entered 1x",
            "call: peak *",
            "*_ test_unopened _*",
            "*::test_unopened: max_memory names phase 'forwrd' that the test never opened (opened: forward, backward)",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.no_fnmatch_line("*pytest_gpumem*")


def test_call_limits_on_functions_classes_modules_and_parameters(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        pytestmark = pytest.mark.max_memory("1 KiB")

        @pytest.mark.max_memory(8000)
        def test_fits():
            torch.ones(2000)  # 8000 bytes

        @pytest.mark.max_memory(7999)
        def test_over():
            torch.ones(2000)

        @pytest.mark.max_memory(forward="100 KiB")
        def test_module_cap_still_holds(gpumem):
            with gpumem.phase("forward"):
                torch.ones(1000)  # 4000 B: within forward=100 KiB, over the module's 1 KiB call limit

        @pytest.mark.max_memory("1 MiB")
        @pytest.mark.max_memory("2 KiB")
        def test_stacked_strictest_wins():
            torch.ones(1000)

        @pytest.mark.parametrize("n", [pytest.param(100, marks=pytest.mark.max_memory("512 B")), 10])
        @pytest.mark.max_memory("1 MiB")
        def test_param_marks(n):
            torch.ones(n)

        @pytest.mark.max_memory("3 KiB")
        class TestClassMarker:
            def test_small(self):
                torch.ones(768)

            def test_big(self):
                torch.ones(769)
        """
    )
    result = tracker.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=4, failed=4)
    result.stdout.fnmatch_lines(
        [
            "*_ test_over _*",
            "call peak 7.8 KiB (8,000 B) exceeds max_memory 7999 B*",
            "*_ test_module_cap_still_holds _*",
            "call peak 3.9 KiB exceeds max_memory 1 KiB "
            "(see what made it with --gpumem-explain or max_memory(explain=True))",
            "*_ test_stacked_strictest_wins _*",
            "call peak 3.9 KiB exceeds max_memory 2 KiB (see what made it with --gpumem-explain*",
            "*_ TestClassMarker.test_big _*",
            "call peak 3.0 KiB (3,076 B) exceeds max_memory 3 KiB*",
        ]
    )


def test_a_bad_marker_fails_only_its_test_in_one_line_and_the_files_are_still_written(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    """Sizes travel as JSON integers: one beyond 64 bits fails its test, and the report and the baseline
    file are still written, without it."""
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory(10**400)
        def test_huge_int():
            pass

        @pytest.mark.max_memory("9" * 5000 + " GiB")
        def test_huge_text():
            pass

        @pytest.mark.max_memory("2 apples")
        def test_apples():
            pass

        @pytest.mark.max_memory("1 MiB")
        def test_fine():
            torch.ones(10)  # something to record: a test that allocates nothing needs no baseline

        def test_unaffected():
            pass
        """
    )
    result = tracker.runpytest("--gpumem-json=out.json", "--gpumem-update", "--gpumem-report")
    result.assert_outcomes(passed=2, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*::test_huge_int: max_memory limit: size must be below 2**63 bytes, got 1000*",
            "*::test_apples: max_memory limit: unknown unit 'apples' in size '2 apples'*",
        ]
    )
    for forbidden in ("*INTERNALERROR*", "*Traceback*", "*During handling*"):
        result.stdout.no_fnmatch_line(forbidden)
    assert max(len(line) for line in result.outlines) < 300
    status = {name: test["status"] for name, test in reported().items()}
    assert status == {"test_huge_int": "error", "test_huge_text": "error", "test_apples": "error", "test_fine": "NEW"}
    stored = json.loads((tracker.path / "gpumem-baselines.json").read_text())["entries"]
    assert [nodeid.split("::")[-1] for nodeid in stored] == ["test_fine"]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "max_memory needs a limit or a tolerance*"),
        ((None,), {}, "max_memory needs a limit or a tolerance*"),
        ((), {"call": "1 MB"}, "max_memory: 'call' is the whole test call; give its limit positionally*"),
        ((-1,), {}, "max_memory limit: size must not be negative, got -1"),
        (("-2 MB",), {}, "max_memory limit: size must not be negative, got '-2 MB'"),
        ((0,), {}, "max_memory limit: a limit must be above zero, got 0"),
        (("0 MiB",), {}, "max_memory limit: a limit must be above zero, got '0 MiB'"),
        (("2 apples",), {}, "max_memory limit: unknown unit 'apples' in size '2 apples'*"),
        (("lots",), {}, "max_memory limit: cannot read size 'lots'*"),
        (
            ("9" * 5000 + " GiB",),
            {},
            "max_memory limit: size text must be at most 100 characters, got '999*...*999 GiB' (5,004 characters)",
        ),
        ((10**400,), {}, "max_memory limit: size must be below 2**63 bytes, got 1000*...*000 (401 digits)"),
        ((-(10**400),), {}, "max_memory limit: size must not be negative, got -1000*...*000 (401 digits)"),
        ((), {"forward": 2**63}, "max_memory forward=: size must be below 2**63 bytes, got 9223372036854775808"),
        (("99999999 TiB",), {}, "max_memory limit: size must be below 2**63 bytes, got '99999999 TiB'"),
        ((), {"tolerance": 10**400}, "max_memory tolerance: must be between 0 and 1000 percent, got 1000*(401 digits)"),
        (
            (),
            {"tolerance": "9" * 5000},
            "max_memory tolerance: text must be at most 100 characters, got '999*(5,000 c*",
        ),
        ((1.5,), {}, "max_memory limit: size must be an int (bytes) or a string like '64 MiB', got 1.5"),
        (([1],), {}, "max_memory limit: size must be an int*got [[]1[]]"),
        ((), {"forward": "1 XB"}, "max_memory forward=: unknown unit 'XB'*"),
        ((), {"forward": True}, "max_memory forward=: size must be an int*got True"),
        (("1 MB", "2 MB"), {}, "max_memory takes one positional limit, got 2*"),
        (("1 MB",), {"limit": "2 MB"}, "max_memory got the limit both positionally and as limit=*"),
        (("1 MB",), {"tolerance": "five"}, "max_memory tolerance: must be a percentage like 5 or '5%', got 'five'"),
        (("1 MB",), {"tolerance": -1}, "max_memory tolerance: must be between 0 and 1000 percent, got -1"),
        ((), {"explain": "yes"}, "max_memory explain=: must be True or False, got 'yes'"),
        ((), {"device": "cuda"}, "max_memory device=: only 'meta' (a prediction without data) is chosen per test*"),
    ],
)
def test_a_bad_argument_is_named_in_one_short_line(args: tuple[Any, ...], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(GpuMemError) as refused:
        budget_from_marker(args, kwargs)
    assert fnmatchcase(str(refused.value), message), str(refused.value)
    assert len(str(refused.value)) < 300


@pytest.mark.parametrize(
    ("args", "kwargs", "described"),
    [
        ((4004,), {}, "4004 B"),
        (("1 MB",), {"tolerance": "7.5%"}, "1 MB, tolerance 7.5%"),
        ((), {"forward": "1 MB", "tolerance": 0}, "forward=1 MB, tolerance 0%"),
        ((), {"tolerance": 10}, "tolerance 10%"),
        ((), {"leak": 0, "capacity": "2 GiB"}, "capacity 2 GiB, leak 0 B"),
        ((), {"device": "meta", "explain": True}, "on meta, explained"),
    ],
)
def test_a_good_marker_reads_as_written(args: tuple[Any, ...], kwargs: dict[str, Any], described: str) -> None:
    assert budget_from_marker(args, kwargs).describe() == described


def test_sizes_keep_their_family_of_units() -> None:
    budget = budget_from_marker(("4 KiB",), {"forward": "4 kB"})
    assert budget.to_json() == {"call": 4096, "forward": 4000}
    assert budget.total is not None
    assert (budget.total.fmt(4000), budget.phases["forward"].fmt(4100)) == ("3.9 KiB", "4.1 kB")


def test_markers_of_one_level_all_hold_and_a_closer_level_overrides_a_farther_one() -> None:
    from pytest_gpumem.budget import all_of, closest_first

    def marker(*args: Any, **kwargs: Any) -> Budget:
        return budget_from_marker(args, kwargs)

    stacked = all_of([marker("1 MiB", tolerance=10, forward="2 KiB"), marker("2 KiB", tolerance=5, forward="1 KiB")])
    assert stacked.to_json() == {"call": 2048, "tolerance": 5, "forward": 1024}
    function, module = marker(forward="100 KiB"), marker("1 KiB", tolerance=3)
    assert closest_first([function, module]).to_json() == {"call": 1024, "forward": 102400, "tolerance": 3}
    assert closest_first([marker("8 KiB"), module]).to_json() == {"call": 8192, "tolerance": 3}


def test_marker_registered_with_every_argument_it_takes(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.max_memory(limit=None, *, tolerance=None, capacity=None, leak=None, device=None, "
            "explain=False, **phase_limits): fail the test *"
        ]
    )
    taken = {"limit": "1 MiB", "tolerance": 5, "capacity": "1 GiB", "leak": 0, "device": "meta", "explain": True}
    assert set(taken) | {"phase_limits"} == set(inspect.signature(max_memory).parameters)
    assert budget_from_marker((), taken).explain


def test_a_marker_added_where_it_cannot_take_effect_fails_its_test_in_one_line(
    pytester: pytest.Pytester, reported: Reported
) -> None:
    """Inside the test function (the call already runs, unmeasured or as marked before; also once the test
    cleared os.environ) and, for meta, after the gpumem fixture was made on the CPU; from a fixture before
    gpumem, a marker takes effect, also in a run where no other test measures."""
    pytester.makepyfile(
        """
        import os
        from unittest import mock

        import pytest, torch

        def test_in_body(request):
            request.node.add_marker(pytest.mark.max_memory(capacity="1 MiB", device="meta"))
            torch.zeros(1024, 1024)

        def test_in_body_measured(request, gpumem):
            request.applymarker(pytest.mark.max_memory("1 MiB"))
            torch.zeros(1024, 1024)

        def test_in_body_without_environment(request):
            with mock.patch.dict(os.environ, clear=True):  # PYTEST_CURRENT_TEST too
                request.node.add_marker(pytest.mark.max_memory("1 MiB"))

        def test_other_marker_in_body(request):
            request.node.add_marker("slow")
            assert request.node.get_closest_marker("slow") is not None

        @pytest.fixture
        def on_meta(request):
            request.node.add_marker(pytest.mark.max_memory("1 MiB", device="meta"))

        def test_meta_after_gpumem(gpumem, on_meta):
            torch.zeros(1024, 1024, device=gpumem.device)

        def test_meta_before_gpumem(on_meta, gpumem):
            assert str(gpumem.device) == "meta"
            torch.zeros(1024, 1024, device=gpumem.device)  # 4 MiB on meta: over 1 MiB

        @pytest.fixture
        def capped(request):
            request.node.add_marker(pytest.mark.max_memory("1 KiB"))

        def test_marked_by_a_fixture(capped):
            torch.zeros(1024)  # 4 KiB
        """
    )
    result = pytester.runpytest("-p", "no:randomly", "--gpumem-backend=tracker", "--gpumem-json=out.json")
    result.assert_outcomes(passed=1, failed=6)
    result.stdout.fnmatch_lines(
        [
            "*::test_in_body: max_memory added inside the test function, after its call began: it would be "
            "ignored; put it on the test (a decorator, pytestmark or pytest.param(..., marks=...)) or add it "
            "from a fixture",
            "*::test_in_body_measured: max_memory added inside the test function*",
            "*::test_in_body_without_environment: max_memory added inside the test function*",
            "*::test_meta_after_gpumem: max_memory(device='meta') was added after the gpumem fixture was made on "
            "cpu: the test would run on cpu; put it on the test*from a fixture that runs before gpumem",
            "*call peak 4.0 MiB exceeds max_memory 1 MiB*",
            "*call peak 4.0 KiB exceeds max_memory 1 KiB*",
        ]
    )
    assert_one_line_failure(result)
    status = {name: test["status"] for name, test in reported().items()}
    assert status["test_meta_before_gpumem"] == status["test_marked_by_a_fixture"] == "OVER BUDGET"
    alone = pytester.runpytest("-p", "no:randomly", "--gpumem-backend=tracker", "-k", "test_marked_by_a_fixture")
    alone.assert_outcomes(failed=1)
    alone.stdout.fnmatch_lines(["*call peak 4.0 KiB exceeds max_memory 1 KiB*"])
    idle = pytester.runpytest("-p", "no:randomly", "-k", "test_in_body and not measured")  # nothing measures
    idle.assert_outcomes(failed=2)
    idle.stdout.fnmatch_lines(
        [f"*::test_in_body{end}: max_memory added inside the test function*" for end in ("", "_without_environment")]
    )


def test_a_marker_a_setup_hook_adds_after_ours_is_measured(pytester: pytest.Pytester) -> None:
    """A conftest's `trylast` setup hook runs after every plugin's: its marker still takes effect."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_runtest_setup(item):
            item.add_marker(pytest.mark.max_memory("1 KiB"))
        """
    )
    pytester.makepyfile("import torch\n\ndef test_over():\n    torch.zeros(1024)  # 4 KiB\n")
    result = pytester.runpytest("--gpumem-backend=tracker")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*call peak 4.0 KiB exceeds max_memory 1 KiB*"])


def test_a_reruns_fixtures_may_mark_and_measure_after_one_cleared_the_environment(tracker: pytest.Pytester) -> None:
    """A rerun's setup is a setup even where a fixture cleared os.environ (PYTEST_CURRENT_TEST with it)."""
    pytest.importorskip("pytest_rerunfailures")
    tracker.makepyfile(
        """
        import os
        from unittest import mock

        import pytest

        ATTEMPTS = []

        @pytest.fixture
        def cleared():
            with mock.patch.dict(os.environ, clear=True):
                yield

        @pytest.fixture
        def capped(request, cleared):
            request.node.add_marker(pytest.mark.max_memory("1 GiB"))

        @pytest.mark.flaky(reruns=1)
        def test_marked(capped):
            ATTEMPTS.append("marked")
            assert ATTEMPTS.count("marked") == 2

        @pytest.mark.flaky(reruns=1)
        def test_measured(cleared, gpumem):
            ATTEMPTS.append("measured")
            assert ATTEMPTS.count("measured") == 2
        """
    )
    assert tracker.runpytest("-p", "no:randomly").parseoutcomes() == {"passed": 2, "rerun": 2}


def test_a_tests_own_capacity_leak_and_explain_come_before_the_runs_options() -> None:
    from pytest_gpumem.backends.base import Settings
    from pytest_gpumem.measure.terms import Terms

    own, run = budget_from_marker((), {"capacity": "2 kB", "leak": 0}), budget_from_marker((), {"capacity": "1 MB"})
    terms = Terms.of(own, run.capacity, None, evidence=False)
    assert (terms.capacity, terms.leak, terms.card) == (own.capacity, own.leak, None)
    assert terms.settings() == Settings(2000, origins=True, events=False, explain=False)  # a leak needs origins
    carded = Terms.of(None, budget_from_marker((), {"capacity": "H100-80GB"}).capacity, None, evidence=True)
    assert (carded.card, carded.settings().events, carded.settings().origins) == ("H100-80GB", True, True)
    explained = Terms.of(budget_from_marker((), {"explain": True}), None, None, evidence=False)
    assert explained.settings() == Settings(None, explain=True) and explained.explaining(False) is explained


def test_a_max_memory_marker_is_found_on_the_test_or_a_level_above_as_pytest_finds_it(
    pytester: pytest.Pytester,
) -> None:
    """The idle run's lookup (`_marked`, asked at collection and after each setup) reads the markers pytest's
    `get_closest_marker` reads, and defers to an item class that reads them its own way."""
    from pytest_gpumem.plugin import _marked

    items = pytester.getitems(
        """
        import pytest

        pytestmark = pytest.mark.slow

        def test_plain():
            pass

        @pytest.mark.max_memory("1 MiB")
        def test_marked():
            pass

        @pytest.mark.max_memory("1 MiB")
        class TestMarkedClass:
            def test_in_class(self):
                pass

        class TestOther:
            @pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.max_memory("1 MiB"))])
            def test_param(self, n):
                pass
        """
    )
    found = {item.name: _marked(item) for item in items}
    assert found == {item.name: item.get_closest_marker("max_memory") is not None for item in items}
    assert found == {
        "test_plain": False,
        "test_marked": True,
        "test_in_class": True,
        "test_param[1]": False,
        "test_param[2]": True,
    }
    plain = items[0]
    assert plain.parent is not None
    plain.parent.add_marker(pytest.mark.max_memory("1 MiB"))  # as a module-scoped fixture's applymarker does
    assert _marked(plain)

    class ReadsItsOwn(pytest.Function):
        def get_closest_marker(self, name: str, default: Any = None) -> Any:
            return pytest.mark.max_memory("1 MiB").mark if name == "max_memory" else default

    other = items[3]
    other.__class__ = ReadsItsOwn
    assert _marked(other)
