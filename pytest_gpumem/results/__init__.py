"""What a measurement produces: one result per phase and one per test, both JSON-able."""

from pytest_gpumem.results.phase import PHASES as PHASES
from pytest_gpumem.results.phase import RANK_SEPARATOR as RANK_SEPARATOR
from pytest_gpumem.results.phase import PhaseResult as PhaseResult
from pytest_gpumem.results.phase import Phases as Phases
from pytest_gpumem.results.phase import rank_phase as rank_phase
from pytest_gpumem.results.phase import split_rank as split_rank
from pytest_gpumem.results.status import PRECEDENCE as PRECEDENCE
from pytest_gpumem.results.status import Status as Status
from pytest_gpumem.results.status import first_of as first_of
from pytest_gpumem.results.test_result import BudgetView as BudgetView
from pytest_gpumem.results.test_result import Outcome as Outcome
from pytest_gpumem.results.test_result import TestResult as TestResult
from pytest_gpumem.results.test_result import WrittenRecord as WrittenRecord

REPORT_ATTRIBUTE = "gpumem_result"  # the test report's attribute that carries its result (JSON text) to xdist
