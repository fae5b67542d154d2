"""The max_memory marker: limits on each side of a measured peak, and every bad argument."""

from __future__ import annotations

import json

import pytest

# forward peak of torch.sum(x * y) on N float32: the product (4N) and the sum (4): 4004 bytes for N = 1000
STEP = """
import pytest, torch

N = 1000

def step(gpumem):
    x = torch.randn(N, requires_grad=True)
    y = torch.randn(N)
    with gpumem.phase("forward"):
        loss = torch.sum(x * y)
    with gpumem.phase("backward"):
        loss.backward()
"""


@pytest.mark.parametrize(
    ("limit", "passes"),
    [("4004", True), ("4003", False), ("'4004 B'", True), ("'4.004 kB'", True), ("'4.003kB'", False)],
)
def test_phase_limit_edges(tracker: pytest.Pytester, limit: str, passes: bool) -> None:
    tracker.makepyfile(STEP + f"\n@pytest.mark.max_memory(forward={limit})\ndef test_it(gpumem):\n    step(gpumem)\n")
    result = tracker.runpytest()
    result.assert_outcomes(passed=int(passes), failed=int(not passes))
    if not passes:
        result.stdout.fnmatch_lines(["*forward peak * (4,004 B) exceeds max_memory forward=*"])


def test_over_budget_message_and_section(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        STEP + "\n@pytest.mark.max_memory(forward='1 MB', backward='2 kB')\ndef test_it(gpumem):\n    step(gpumem)\n"
    )
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "backward peak 4.0 kB exceeds max_memory backward=2 kB "
            "(see what made it with --gpumem-explain or max_memory(explain=True))",
            "*Captured gpumem call*",
            "forward: peak 3.9 KiB (requested 3.9 KiB), net 4 B, entered 1x",
            "backward: peak 3.9 KiB (requested 3.9 KiB), net 3.9 KiB, entered 1x",
            "call: peak *",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.no_fnmatch_line("*pytest_gpumem*")


def test_whole_call_limit_without_fixture(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_memory(8000)
        def test_fits():
            torch.ones(2000)  # 8000 bytes

        @pytest.mark.max_memory(7999)
        def test_over():
            torch.ones(2000)

        @pytest.mark.max_memory("1 KiB")
        class TestClassMarker:
            def test_small(self):
                torch.ones(256)

            def test_big(self):
                torch.ones(257)
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*call peak 7.8 KiB (8,000 B) exceeds max_memory 7999 B*", "*call peak 1.0 KiB*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("", "max_memory needs a limit or a tolerance*"),
        ("None", "max_memory needs a limit or a tolerance*"),
        ("call='1 MB'", "max_memory: 'call' is the whole test call; give its limit positionally*"),
        ("-1", "max_memory limit: size must not be negative, got -1"),
        ("'-2 MB'", "max_memory limit: size must not be negative, got '-2 MB'"),
        ("0", "max_memory limit: a limit must be above zero, got 0"),
        ("'0 MiB'", "max_memory limit: a limit must be above zero, got '0 MiB'"),
        ("'2 apples'", "max_memory limit: unknown unit 'apples' in size '2 apples'*"),
        ("'lots'", "max_memory limit: cannot read size 'lots'*"),
        (
            "'9' * 5000 + ' GiB'",
            "max_memory limit: size text must be at most 100 characters, got '999*...*999 GiB' (5,004 characters)",
        ),
        ("10**400", "max_memory limit: size must be below 2**63 bytes, got 1000*...*000 (401 digits)"),
        ("-(10**400)", "max_memory limit: size must not be negative, got -1000*...*000 (401 digits)"),
        ("forward=2**63", "max_memory forward=: size must be below 2**63 bytes, got 9223372036854775808"),
        ("'99999999 TiB'", "max_memory limit: size must be below 2**63 bytes, got '99999999 TiB'"),
        ("tolerance=10**400", "max_memory tolerance: must be between 0 and 1000 percent, got 1000*(401 digits)"),
        ("tolerance='9' * 5000", "max_memory tolerance: text must be at most 100 characters, got '999*(5,000 chara*"),
        ("1.5", "max_memory limit: size must be an int (bytes) or a string like '64 MiB', got 1.5"),
        ("[1]", "max_memory limit: size must be an int*got [[]1[]]"),
        ("forward='1 XB'", "max_memory forward=: unknown unit 'XB'*"),
        ("forward=True", "max_memory forward=: size must be an int*got True"),
        ("'1 MB', '2 MB'", "max_memory takes one positional limit, got 2*"),
        ("'1 MB', limit='2 MB'", "max_memory got the limit both positionally and as limit=*"),
        ("'1 MB', tolerance='five'", "max_memory tolerance: must be a percentage like 5 or '5%', got 'five'"),
        ("'1 MB', tolerance=-1", "max_memory tolerance: must be between 0 and 1000 percent, got -1"),
    ],
)
def test_bad_arguments_fail_that_test_in_one_line(tracker: pytest.Pytester, args: str, message: str) -> None:
    tracker.makepyfile(
        f"""
        import pytest

        @pytest.mark.max_memory({args})
        def test_bad():
            pass

        def test_unaffected():
            pass
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"test_bad_arguments_fail_that_test_in_one_line.py::test_bad: {message}"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.no_fnmatch_line("*During handling*")
    assert max(len(line) for line in result.outlines) < 300


def test_huge_limits_are_refused_before_any_file_is_written(tracker: pytest.Pytester) -> None:
    """Sizes travel as JSON integers: one beyond 64 bits fails its test, and the report and the
    baseline file are still written, without it."""
    tracker.makepyfile(
        """
        import pytest

        @pytest.mark.max_memory(10**400)
        def test_huge_int():
            pass

        @pytest.mark.max_memory("9" * 5000 + " GiB")
        def test_huge_text():
            pass

        @pytest.mark.max_memory("1 MiB")
        def test_fine():
            pass
        """
    )
    result = tracker.runpytest("--gpumem-json=out.json", "--gpumem-update", "--gpumem-report")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.fnmatch_lines(["*::test_huge_int: max_memory limit: size must be below 2**63 bytes, got 1000*"])
    data = json.loads((tracker.path / "out.json").read_text())
    status = {t["nodeid"].split("::")[1]: t["status"] for t in data["tests"]}
    assert status == {"test_huge_int": "error", "test_huge_text": "error", "test_fine": "NEW"}
    json.loads((tracker.path / "gpumem-baselines.json").read_text())


def test_unopened_phase_limit(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(STEP + "\n@pytest.mark.max_memory(forwrd='1 MB')\ndef test_it(gpumem):\n    step(gpumem)\n")
    result = tracker.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*::test_it: max_memory names phase 'forwrd' that the test never opened (opened: forward, backward)"]
    )


def test_tolerance_accepted(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest

        @pytest.mark.max_memory("1 MB", tolerance="7.5%")
        def test_a():
            pass

        @pytest.mark.max_memory(forward="1 MB", tolerance=0)
        def test_b(gpumem):
            with gpumem.phase("forward"):
                pass
        """
    )
    tracker.runpytest().assert_outcomes(passed=2)


def test_markers_on_several_levels(tracker: pytest.Pytester) -> None:
    tracker.makepyfile(
        """
        import pytest, torch

        pytestmark = pytest.mark.max_memory("1 KiB")

        @pytest.mark.max_memory(forward="100 KiB")
        def test_module_cap_still_holds(gpumem):
            with gpumem.phase("forward"):
                torch.ones(1000)  # 4000 B: within forward=100 KiB, over the module's 1 KiB call limit

        @pytest.mark.max_memory("8 KiB")
        def test_function_overrides_module():
            torch.ones(1000)

        @pytest.mark.max_memory("1 MiB")
        @pytest.mark.max_memory("2 KiB")
        def test_stacked_strictest_wins():
            torch.ones(1000)

        @pytest.mark.parametrize("n", [pytest.param(100, marks=pytest.mark.max_memory("512 B")), 10])
        @pytest.mark.max_memory("1 MiB")
        def test_param_marks(n):
            torch.ones(n)
        """
    )
    result = tracker.runpytest()
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_module_cap_still_holds _*",
            "call peak 3.9 KiB exceeds max_memory 1 KiB "
            "(see what made it with --gpumem-explain or max_memory(explain=True))",
            "*_ test_stacked_strictest_wins _*",
            "call peak 3.9 KiB exceeds max_memory 2 KiB (see what made it with --gpumem-explain*",
        ]
    )


def test_marker_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        ["@pytest.mark.max_memory(limit=None, *, tolerance=None, capacity=None, leak=None, device=None, *"]
    )
