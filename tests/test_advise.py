"""gpumem.advise: strategies measured on the user's own step with the exact tracker, and undone."""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from builders import Reported
from torch import nn
from torch.nn import functional as F

from pytest_gpumem.advise.run import advise
from pytest_gpumem.backends.base import Settings
from pytest_gpumem.backends.tracker.backend import TrackerBackend
from pytest_gpumem.errors import GpuMemError
from pytest_gpumem.measure.measurement import Measurement
from pytest_gpumem.measure.meter import GpuMem
from pytest_gpumem.report.advice_text import advice_clause
from pytest_gpumem.results.advice import AS_IS, Advice, PhasePeak, Row
from pytest_gpumem.results.checks import OffShape
from reference_losses.bounds import NetBytes
from reference_losses.models import ModelWorkload, build_net, build_residual
from reference_losses.training import TRAINING_STRATEGIES, plain, residual_plain

F4 = 4  # bytes of a float32
B, D, H, L = 8, 16, 32, 4  # rows, width, hidden width (2 D), blocks of the hand-derived stack
SEED = 4  # the 0-d gradient seed torch.autograd.backward makes before autograd's engine runs


class Pair(nn.Module):
    """fc2(fc1(x)) without biases: saves its input x (B x D) for fc1 and h (B x H) for fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))  # type: ignore[no-any-return]


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Pair() for _ in range(L)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)  # type: ignore[no-any-return]


def _tracked(fn: Callable[[TrackerBackend], Any], device: str = "cpu") -> Any:  # returns what fn does
    backend = TrackerBackend(device=device)
    backend.start()
    try:
        return fn(backend)
    finally:
        backend.stop()


def _stack_step(device: str = "cpu", optimizer: Any = torch.optim.SGD) -> Any:
    torch.manual_seed(0)
    model = Stack().to(device)
    opt = optimizer(model.parameters(), lr=0.1)
    x, target = torch.randn(B, D, device=device), torch.randn(B, D, device=device)

    def step(batch: slice = slice(None)) -> None:
        loss = (model(x[batch]) * target[batch]).sum() / x[batch].shape[0]
        loss.backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def _advise_stack(names: list[str] | None = None, **options: Any) -> Advice:
    model, opt, step = _stack_step()
    found: Advice = _tracked(
        lambda be: advise(step, model=model, optimizer=opt, backend=be, strategies=names, **options)
    )
    return found


def test_checkpointing_all_blocks_keeps_only_block_outputs_and_recomputes_each_block_once() -> None:
    advice = _advise_stack(["checkpoint-blocks"])
    bd, bh = B * D * F4, B * H * F4
    # plain forward: block outputs x1..xL (L BD) and each block's h (L BH), when the product x_L * target
    # (BD) is made; x_L, not saved by mul (target needs no gradient), dies before the sum's 4 B
    assert advice.as_is.region_peak("forward") == (L + 1) * bd + L * bh
    # checkpointed: block outputs so far (L-1 BD) + the last block's h (BH) and output (BD); the
    # product later is smaller, (L+1) BD + 4, as H = 2 D
    row = advice.row("checkpoint-blocks")
    assert row.region_peak("forward") == (L - 1) * bd + bh + bd
    assert row.description == "checkpointing the 4 `Pair`s"
    # backward recomputes each block's fc1 (2 B D H FLOPs): non-reentrant checkpoint stops recomputing
    # once every tensor the block saved is back, and fc2 saves its input, not its output
    assert row.extra_flops == L * 2 * B * D * H
    assert row.gradients_equal is True


def test_fused_step_on_the_qa_net_never_holds_two_weight_gradients() -> None:
    w = build_net(1 / 64, torch.device("cpu"))
    opt = torch.optim.SGD(w.model.parameters(), lr=w.lr)

    def step() -> None:
        plain(w).backward()  # type: ignore[no-untyped-call]
        opt.step()

    advice = _tracked(lambda be: advise(step, model=w.model, optimizer=opt, backend=be, strategies=["fused-step"]))
    b = NetBytes.of(w)
    bias2 = F4 * 1024
    # as-is backward ends with every gradient: P. Fused: layer2's backward makes dout, dW2, db2 and dh1
    # before its hooks step and free dW2 and db2; layer1's gradients then come one at a time
    assert advice.as_is.region_peak("backward") == b.params
    row = advice.row("fused-step")
    assert row.region_peak("backward") == b.out + b.w2 + bias2 + b.acts
    assert [p.name for p in row.phases] == ["forward", "backward"]  # no optimizer step left after backward
    assert row.saving_bytes == b.params - (b.out + b.w2 + bias2 + b.acts)
    assert row.extra_flops == 0 and row.gradients_equal is True


def _reference(name: str, w: ModelWorkload) -> tuple[int, dict[str, int]]:
    measured = Measurement(TrackerBackend(), name)
    meter = GpuMem(measured)
    measured.begin()
    TRAINING_STRATEGIES[name].step(meter, w)
    call = measured.end().call
    return call.peak_bytes, {k: v.peak_bytes for k, v in measured.phases.items()}


def _advise_workload(w: ModelWorkload, forward: Callable[[ModelWorkload], torch.Tensor], names: list[str]) -> Advice:
    opt = torch.optim.SGD(w.model.parameters(), lr=w.lr)

    def step(batch: slice = slice(None)) -> None:
        forward(ModelWorkload(w.model, w.inputs[batch], w.target[batch])).backward()  # type: ignore[no-untyped-call]
        opt.step()

    found: Advice = _tracked(
        lambda be: advise(step, model=w.model, optimizer=opt, backend=be, strategies=names, batch_size=w.batch)
    )
    return found


@pytest.mark.parametrize(
    ("workload", "pairs"),
    [
        ("net", {AS_IS: "plain", "fused-step": "optimizer_in_backward", "bf16-autocast": "amp"}),
        (
            "residual",
            {
                AS_IS: "residual_plain",
                "checkpoint-blocks": "checkpoint_blocks",
                "selective-checkpoint": "selective_checkpoint",
                "micro-batch-4": "grad_accumulation",
            },
        ),
    ],
)
def test_advice_rows_measure_the_bytes_of_the_reference_strategies(workload: str, pairs: dict[str, str]) -> None:
    build, forward = (build_net, plain) if workload == "net" else (build_residual, residual_plain)
    scale = 1 / 32
    advice = _advise_workload(build(scale, torch.device("cpu")), forward, [n for n in pairs if n != AS_IS])
    for row_name, reference in pairs.items():
        total, phases = _reference(reference, build(scale, torch.device("cpu")))
        row = advice.row(row_name)
        # grad_accumulation's `total += loss.detach()` keeps one more 0-d float than the user's step
        assert row.peak_bytes == total - (4 if reference == "grad_accumulation" else 0), row_name
        assert row.region_peak("forward") == phases["forward"], row_name
        # the reference's backward phase also holds the gradient seed, made before autograd's engine runs
        assert row.region_peak("backward") == phases["backward"] - SEED, row_name


def test_gradients_that_a_strategy_changes_are_reported_as_different_naming_the_parameter() -> None:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, D)

    def clipped_step() -> None:
        model(x).square().sum().backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)  # a fused step runs before clipping
        opt.step()

    advice = _tracked(lambda be: advise(clipped_step, model=model, optimizer=opt, backend=be))
    assert advice.row("fused-step").gradients_equal is False
    assert advice.row("fused-step").gradients.startswith("differ (error ")
    assert re.fullmatch(r"differ \(error \S+ > 1e-04 in blocks\.\d\.fc\d\.weight\)", advice.row("fused-step").gradients)
    assert advice.row("checkpoint-blocks").gradients_equal is True
    assert advice.row("bf16-autocast").gradients_equal is True  # within bf16's tolerance
    assert all("fused-step" not in r.strategies for r in advice.rows if r.gradients_equal)


def test_strategies_that_do_not_apply_are_skipped_with_their_reason() -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    class Custom(torch.optim.SGD):
        pass

    opt = Custom(model.parameters(), lr=0.1)

    def step() -> None:
        model(x).sum().backward()
        opt.step()

    advice = _tracked(lambda be: advise(step, model=model, optimizer=opt, backend=be))
    reasons = {r.name: r.skipped for r in advice.rows}
    assert reasons["checkpoint-blocks"] == (
        "no repeated blocks: no nn.ModuleList or nn.Sequential of two or more modules of one class"
    )
    assert reasons["save-on-cpu"] == "on cpu the saved activations are in host memory already"
    assert (
        reasons["fused-step"] == "Custom is not one of torch's per-parameter optimizers: its step may couple parameters"
    )
    assert reasons["foreach-off"] == "Custom already takes the per-tensor loop on cpu"
    assert reasons["micro-batch-2"] == "the step has no optional `batch` parameter (a slice of the batch rows)"
    assert reasons["chunked-ce"] is not None and reasons["chunked-ce"].startswith("no loss= given")
    assert "  skipped save-on-cpu: on cpu the saved activations are in host memory already" in advice.lines()


def _hooks(model: nn.Module) -> list[Any]:
    found: list[Any] = []
    for module in model.modules():
        found += [
            dict(getattr(module, n))
            for n in vars(module)
            if n.endswith("_hooks") and isinstance(getattr(module, n), dict)
        ]
        found.append("forward" in vars(module))
    found += [p._post_accumulate_grad_hooks for p in model.parameters()]
    found += [dict(p._backward_hooks or {}) for p in model.parameters()]
    return found


def test_advise_leaves_model_optimizer_and_rng_exactly_as_they_were() -> None:
    model, opt, step = _stack_step(optimizer=torch.optim.Adam)
    step()  # Adam now has state (step, exp_avg, exp_avg_sq) and the parameters moved
    params = list(model.parameters())
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt_state["state"].items()}
    groups, state_object, hooks = opt.param_groups, opt.state, _hooks(model)
    torch.manual_seed(123)
    rng = torch.get_rng_state()

    def measured_step(backend: TrackerBackend) -> int:
        backend.reset_peak()
        start = backend.current().allocated
        step()
        return backend.peak().allocated - start

    def check(backend: TrackerBackend) -> tuple[int, int]:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        opt_saved = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
        first = measured_step(backend)
        model.load_state_dict(saved)
        for p, entry in zip(params, opt_saved.values(), strict=True):
            for k, v in entry.items():
                opt.state[p][k].copy_(v)
        torch.set_rng_state(rng)
        advice = advise(step, model=model, optimizer=opt, backend=backend, batch_size=B)
        assert advice.row("fused-step").measured and advice.row("micro-batch-2").measured
        assert torch.equal(torch.get_rng_state(), rng)
        assert list(model.parameters()) == params and all(
            a is b for a, b in zip(model.parameters(), params, strict=True)
        )
        assert opt.param_groups is groups and opt.state is state_object and _hooks(model) == hooks
        after = model.state_dict()
        assert all(torch.equal(after[k], saved[k]) for k in saved)
        for i, entry in opt.state_dict()["state"].items():
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(opt_saved[i][k])) for k, v in entry.items())
        return first, measured_step(backend)

    first, again = _tracked(check)
    assert first == again  # the step after advise allocates what it did before
    assert state_before.keys() == model.state_dict().keys() and opt_before.keys() == opt.state_dict()["state"].keys()


def test_a_strategy_the_step_does_not_survive_leaves_nothing_and_says_why_in_full() -> None:
    model, opt = nn.Linear(256, 256), None
    message = "the step broke under autocast: " + "because " * 40  # 351 characters, said whole

    def step() -> None:
        out = model(torch.ones(64, 256))
        if torch.is_autocast_enabled("cpu"):
            cycle: list[object] = [torch.ones(1_000_000), out]  # 4 MB and a graph, kept by a reference cycle
            cycle.append(cycle)
            raise RuntimeError(message)
        out.sum().backward()

    def check(backend: TrackerBackend) -> tuple[int, str | None]:
        before = backend.current().allocated
        advice = advise(step, model=model, optimizer=opt, backend=backend, strategies=["bf16-autocast"])
        return backend.current().allocated - before, advice.row("bf16-autocast").skipped

    left, skipped = _tracked(check)
    assert left == 0  # the failed run's tensors are gone, reference cycles and all
    assert skipped == f"the step raised RuntimeError: {message.strip()}"


def test_advise_runs_on_meta_without_data_and_checks_no_gradients() -> None:
    w = build_net(1 / 64, torch.device("meta"))
    opt = torch.optim.SGD(w.model.parameters(), lr=1.0)

    def step() -> None:
        plain(w).backward()  # type: ignore[no-untyped-call]
        opt.step()

    advice = _tracked(lambda be: advise(step, model=w.model, optimizer=opt, backend=be, capacity="64 MiB"), "meta")
    b = NetBytes.of(w)
    workspace = 8 * 2**20 + 128 * 2**10  # backward's cuBLAS handle makes its workspace there (every run anew)
    assert advice.row("fused-step").region_peak("backward") == b.out + b.w2 + F4 * 1024 + b.acts + workspace
    assert advice.as_is.gradients == "not checked (meta: no data)" and advice.as_is.gradients_equal is None
    assert advice.row("bf16-autocast").precision == "bfloat16"  # CUDA's autocast, emulated on meta
    assert advice.resident_bytes == b.params
    best = advice.best()
    assert best is not None and best.name == AS_IS  # 16 MiB of parameters + its peak fit 64 MiB


class Head(nn.Module):
    """The loss a user hands to advise: cross-entropy of hidden @ weight.T."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width) / width**0.5)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(hidden @ self.weight.T, targets)


def test_chunked_cross_entropy_swaps_the_loss_module_and_keeps_the_gradients() -> None:
    torch.manual_seed(0)
    tokens, width, vocab = 64, 16, 1024
    trunk, head = nn.Linear(width, width), Head(width, vocab)
    model = nn.ModuleDict({"trunk": trunk, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(tokens, width), torch.randint(0, vocab, (tokens,))

    def step() -> None:
        head(trunk(x), y).backward()
        opt.step()

    advice = _tracked(
        lambda be: advise(step, model=model, optimizer=opt, backend=be, loss=head, strategies=["chunked-ce"])
    )
    row = advice.row("chunked-ce")
    logits = F4 * tokens * vocab
    # as-is keeps the full logits' log-softmax (L) after making the logits (L); chunked keeps 1/8 at a time
    assert advice.as_is.region_peak("forward") >= 2 * logits
    # the trunk's output, one chunk's logits and log-softmax, and four 0-d floats of the running sums
    assert row.region_peak("forward") == F4 * tokens * width + 2 * (logits // 8) + 4 * F4
    assert row.gradients_equal is True
    assert "forward" not in vars(head)


def test_bad_arguments_fail_in_one_line() -> None:
    model, _, step = _stack_step()
    with pytest.raises(GpuMemError, match=r"no strategy 'checkpoint' \(known: checkpoint-blocks, "):
        _tracked(lambda be: advise(step, model=model, backend=be, strategies=["checkpoint"]))
    with pytest.raises(GpuMemError, match=r"model=\.\.\.\) must be a torch.nn.Module, got 3"):
        _tracked(lambda be: advise(step, model=3, backend=be))  # type: ignore[arg-type]
    with pytest.raises(GpuMemError, match=r"capacity=\.\.\.\): "):
        _tracked(lambda be: advise(step, model=model, backend=be, capacity="2 apples"))
    with pytest.raises(GpuMemError, match=r"needs a capacity"):
        Advice((Row(AS_IS, "", (), peak_bytes=1),), None, 0, "tracker", "cpu").best()


def _row(name: str, peak: int, extra: int, forward: int | None = None, equal: bool | None = True) -> Row:
    phases = () if forward is None else (PhasePeak("forward", forward),)
    return Row(name, f"doing {name}", (name,), peak_bytes=peak, phases=phases, extra_flops=extra, gradients_equal=equal)


@pytest.mark.parametrize("warm", [False, True], ids=["first-step", "later-step"])
def test_best_judges_the_absolute_peak_what_is_live_at_the_start_plus_the_step_above_it(warm: bool) -> None:
    p, bh = L * 2 * D * H * F4, B * H * F4  # parameters (= each gradient set, = SGD's momentum buffers)
    model, opt, step = _stack_step(optimizer=functools.partial(torch.optim.SGD, momentum=0.9))
    if warm:
        step()  # the momentum buffers now exist: the step starts from them
    advice: Advice = _tracked(
        lambda be: advise(step, model=model, optimizer=opt, backend=be, strategies=["checkpoint-blocks"])
    )
    # made before the tracker observed: counted from the model's storages, not from the backend
    assert advice.live_bytes == advice.resident_bytes == (2 * p if warm else p)
    row = advice.as_is
    if not warm:
        # the first step makes the momentum buffers (P) while the gradients (P) and the loss (4 B) live
        assert row.peak_bytes == 2 * p + 4 and row.peak_phase == "step"
        assert advice.absolute(row) == 3 * p + 4
    else:
        # later steps peak in backward: every gradient, the first fc1's output gradient (B H), the loss
        # and the gradient seed (4 B each); the step only updates buffers in place
        assert row.peak_bytes == p + bh + 8 and row.peak_phase == "backward"
        assert row.region_peak("step") == 0 and row.phases[-1].above_start == p + 4
        assert advice.absolute(row) == 3 * p + bh + 8
        assert (
            advice.lines()[1]
            == "  as-is: peak 49.0 KiB in backward = 32.0 KiB at the start + 17.0 KiB; no extra compute"
        )
    assert advice.best(advice.absolute(row)) is row
    assert advice.best(advice.absolute(row) - 1) is None  # checkpointing lowers neither peak


def test_live_bytes_count_what_the_backend_saw_allocated_once() -> None:
    def made_while_tracked(backend: TrackerBackend) -> Advice:
        model, opt, step = _stack_step()
        return advise(step, model=model, optimizer=opt, backend=backend, strategies=[])

    advice: Advice = _tracked(made_while_tracked)
    # the parameters (counted by the tracker, not again from the model) and the step's x and target
    assert advice.live_bytes == L * 2 * D * H * F4 + 2 * B * D * F4
    assert advice.resident_bytes == L * 2 * D * H * F4


def test_best_is_the_least_extra_compute_that_fits_with_what_the_step_starts_from() -> None:
    rows = (_row(AS_IS, 100, 0), _row("a", 60, 50), _row("b", 40, 10), _row("c", 10, 0, equal=False))
    advice = Advice(rows, None, 20, "tracker", "cpu")
    assert advice.best(120) is rows[0]  # as-is fits: nothing to change
    assert advice.best(70) is rows[2]  # b (+10 FLOPs) before a (+50); c's gradients differ
    assert advice.best(50) is None


def test_failure_clause_moves_the_measured_peak_by_the_strategys_change() -> None:
    from pytest_gpumem.budget import Budget, Limit
    from pytest_gpumem.results import PhaseResult

    base = Row(AS_IS, "", (), peak_bytes=100, phases=(PhasePeak("forward", 90),), flops=100, extra_flops=0)
    advice = Advice((base, _row("ckpt", 70, 31, forward=50)), None, 0, "tracker", "cpu")
    budget = Budget(phases={"forward": Limit(80, "80 B", binary=True)})
    forward, call = PhaseResult("forward", 95, 95, None, 95), PhaseResult("call", 110, 110, None, 0)
    # 95 B measured - 90 B as-is + 50 B with the strategy
    assert (
        advice_clause(advice, budget, call, {"forward": forward})
        == "; doing ckpt fits the budget: forward peak 55 B, +31% compute"
    )
    tight = Budget(phases={"forward": Limit(40, "40 B", binary=True)})
    assert advice_clause(advice, tight, call, {"forward": forward}) == (
        "; none of the 1 strategies advise measured fits the budget (lowest: ckpt, step peak 70 B above its start)"
    )
    assert advice_clause(None, budget, call, {"forward": forward}) == ""
    # out of memory: the absolute peak, 20 B live at the start + 70 B, against the capacity
    oom = Advice((base, _row("ckpt", 70, 31, forward=50)), 100, 20, "tracker", "cpu")
    assert advice_clause(oom, None, oom=True) == (
        "; doing ckpt fits 100 B: peak 90 B with the 20 B live when the step starts, +31% compute"
    )
    assert advice_clause(dataclasses.replace(oom, capacity=89), None, oom=True) == (
        "; none of the 1 strategies advise measured fits 89 B (lowest: ckpt, peak 90 B with the 20 B live at the start)"
    )


def test_failing_budget_names_the_best_strategy_and_reports_the_rows(
    tracker: pytest.Pytester, reported: Reported
) -> None:
    tracker.makepyfile(
        """
        import pytest, torch
        from reference_losses.models import build_net
        from reference_losses.training import plain

        @pytest.mark.max_memory(backward="12 MiB")
        def test_train(gpumem):
            w = build_net(1 / 64, torch.device("cpu"))
            opt = torch.optim.SGD(w.model.parameters(), lr=1.0)
            def step():
                with gpumem.phase("forward"):
                    loss = plain(w)
                with gpumem.phase("backward"):
                    loss.backward()
                opt.step()
            gpumem.advise(step, model=w.model, optimizer=opt, strategies=["checkpoint-blocks", "fused-step"])
            step()
        """
    )
    result = tracker.runpytest("-p", "no:cacheprovider", "--gpumem-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            # moved from the measured 16.0 MiB to dout + dW2 + db2 + dh1 = 32 KiB + 8 MiB + 4 KiB + 64 KiB
            "backward peak 16.0 MiB exceeds max_memory backward=12 MiB; fused-step fits: backward peak 8.1 MiB, "
            "no extra compute",  # the strategy by its name: 161 columns with its description
            "*Captured gpumem call*",
            "also: the optimizer step fused into backward fits the budget: backward peak 8.1 MiB, no extra compute",
            "*advice (tracker on cpu*): absolute peaks; * live at the step's start, 16.0 MiB of it model state",
            "*fused-step: peak * in backward = * at the start + *, saves *; no extra compute",
            "*skipped checkpoint-blocks: no repeated blocks*",
        ]
    )
    (test,) = reported().values()
    rows = test["advice"]["rows"]
    assert [r["name"] for r in rows] == [AS_IS, "checkpoint-blocks", "fused-step"]


def test_best_counts_a_change_of_precision_as_a_cost_before_compute() -> None:
    """bf16 autocast stacked on checkpointing saves a little more at the same compute: the checkpointed
    row at the step's own precision is the cheaper one; bf16 is chosen only where nothing else fits."""
    ckpt = _row("checkpoint-blocks", 60, 10)
    both = dataclasses.replace(_row("bf16-autocast + checkpoint-blocks", 59, 10), precision="bfloat16")
    bf16 = dataclasses.replace(_row("bf16-autocast", 80, 0), precision="bfloat16")
    advice = Advice((_row(AS_IS, 100, 0), ckpt, both, bf16), None, 0, "tracker", "cpu")
    assert advice.best(90) is ckpt  # before bf16 alone, which costs no compute
    assert advice.best(59) is both
    assert (
        advice.lines()[5]
        == "  bf16-autocast + checkpoint-blocks: peak 59 B = 0 B at the start + 59 B, saves 0 B; +10 FLOPs; in bfloat16"
    )


def test_advice_not_as_advise_writes_it_is_refused_naming_the_first_value() -> None:
    row = {"name": "fused-step", "description": "", "strategies": ["fused-step"], "skipped": "no optimizer"}
    written = {
        "capacity": None,
        "live_bytes": 8,
        "resident_bytes": 0,
        "backend": "tracker",
        "device": "cpu",
        "seconds": 0.5,
        "rows": [row],
        "conflicts": [],
    }
    assert Advice.from_json(written).rows[0].skipped == "no optimizer"
    with pytest.raises(OffShape, match=r"^advice\.live_bytes must be an integer, got '8'$"):
        Advice.from_json({**written, "live_bytes": "8"})
    with pytest.raises(OffShape, match=r"^advice\.rows\[0\] has an unknown key \"extra\"$"):
        Advice.from_json({**written, "rows": [{**row, "extra": 1}]})
    with pytest.raises(OffShape, match=r"^advice\.rows\[0\]\.seconds must be a number, got None$"):
        Advice.from_json({**written, "rows": [{**row, "seconds": None}]})
    with pytest.raises(OffShape, match=r"^advice\.rows must be a list, got None$"):
        Advice.from_json({**written, "rows": None})
    with pytest.raises(OffShape, match=r"^advice has no \"capacity\"$"):
        Advice.from_json({k: v for k, v in written.items() if k != "capacity"})


def test_an_advice_figure_it_derives_is_read_only_as_it_would_write_it() -> None:
    """A measured row's absolute peak is what was live at the step's start (8 B) + its peak (100 B)."""
    advice = Advice((Row(AS_IS, "", (), peak_bytes=100, phases=(PhasePeak("forward", 60, 70),)),), None, 8, "t", "cpu")
    written = advice.to_json()
    assert written["rows"][0]["absolute_peak_bytes"] == 108 and written["rows"][0]["absolute_phases"] == {"forward": 78}
    assert Advice.from_json(written) == advice
    row = written["rows"][0]
    with pytest.raises(
        OffShape, match=r"^advice\.rows\[0\]\.absolute_peak_bytes is not as pytest-gpumem writes it, got 100$"
    ):
        Advice.from_json({**written, "rows": [{**row, "absolute_peak_bytes": 100}]})
    with pytest.raises(OffShape, match=r"^advice\.rows\[0\] has no \"calls\"$"):
        Advice.from_json({**written, "rows": [{k: v for k, v in row.items() if k != "calls"}]})


def test_every_run_is_timed_and_the_report_says_where_the_time_went() -> None:
    advice = _advise_stack(["checkpoint-blocks", "save-on-cpu"])
    ran = [r for r in advice.rows if r.name != "save-on-cpu"]
    assert all(r.seconds is not None and 0 < r.seconds <= advice.seconds for r in ran)
    assert advice.row("save-on-cpu").seconds is None  # does not apply: never run
    assert advice.lines()[-1].startswith("  time: as-is ") and "the other run " in advice.lines()[-1]


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack, self.drop = Stack(), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.stack(self.drop(x)))  # type: ignore[no-any-return]


def test_micro_batches_of_a_step_with_dropout_are_not_judged_by_gradients_the_random_masks_change() -> None:
    torch.manual_seed(0)
    model = Dropped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, D)

    def step(batch: slice = slice(None)) -> None:
        model(x[batch]).square().mean().backward()
        opt.step()

    names = ["checkpoint-blocks", "micro-batch-2"]
    advice = _tracked(lambda be: advise(step, model=model, optimizer=opt, backend=be, strategies=names, batch_size=B))
    micro = advice.row("micro-batch-2")
    assert micro.gradients_equal is None and micro in advice.usable()
    assert re.fullmatch(
        r"not checked: the random numbers differ between the runs \(1 dropout module in training mode; "
        r"error \S+ > 1e-04 in stack\.blocks\.\d\.fc\d\.weight\)",
        micro.gradients,
    )
    assert advice.row("checkpoint-blocks").gradients_equal is True  # checkpoint replays the RNG's state
    assert f"    gradients {micro.gradients}" in advice.lines()  # too long to share the phases' line


class Cached(Stack):
    """A Hugging Face-style model whose config keeps each block's output as a cache when `use_cache` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=True)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.config.use_cache)
        self.cache = []
        for block in self.blocks:
            x = block(x)
            if self.config.use_cache:
                self.cache.append(x.detach() * 1)  # a copy: HF's cache keeps its own key and value tensors
        return x


def test_checkpointing_turns_use_cache_off_as_hugging_faces_checkpointing_does_and_says_so() -> None:
    torch.manual_seed(0)
    model = Cached()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, D)

    def step() -> None:
        model(x).sum().backward()
        opt.step()

    advice = _tracked(lambda be: advise(step, model=model, optimizer=opt, backend=be, strategies=["checkpoint-blocks"]))
    row, bd, bh = advice.row("checkpoint-blocks"), B * D * F4, B * H * F4
    assert row.description == "checkpointing the 4 `Pair`s, use_cache off as Hugging Face's checkpointing sets it"
    assert model.seen == [True, False] and model.config.use_cache is True  # as-is, checkpointed; then put back
    # no cache: block outputs so far (L-1 BD) + the last block's h (BH) and output (BD), as for the plain Stack
    assert row.region_peak("forward") == (L - 1) * bd + bh + bd


def test_a_step_that_never_steps_the_optimizer_is_not_fused_and_says_why() -> None:
    """Gradient accumulation: fusing would add optimizer steps, micro-batching has no step to average in."""
    model, opt, _ = _stack_step()
    x = torch.randn(B, D)

    def accumulate(batch: slice = slice(None)) -> None:
        model(x[batch]).sum().backward()

    names = ["fused-step", "micro-batch-2", "checkpoint-blocks"]
    advice = _tracked(
        lambda be: advise(accumulate, model=model, optimizer=opt, backend=be, strategies=names, batch_size=B)
    )
    never = "the step as it is never calls optimizer.step() (it accumulates gradients): "
    assert (
        advice.row("fused-step").skipped
        == never + "fused, the optimizer would step in every backward and free the gradients"
    )
    assert (
        advice.row("micro-batch-2").skipped == never + "micro-batching averages the accumulated gradients in that step"
    )
    assert advice.row("checkpoint-blocks").gradients_equal is True


def test_strategies_given_as_any_iterable_are_all_tried() -> None:
    wanted = ["checkpoint-blocks", "fused-step"]
    for given in (iter(wanted), (name for name in wanted), tuple(wanted), dict.fromkeys(wanted)):
        advice = _advise_stack(given)  # type: ignore[arg-type]
        assert [r.name for r in advice.rows] == [AS_IS, *wanted]


def test_a_step_holding_the_bound_phase_measures_no_phase_while_advise_runs() -> None:
    measured = Measurement(TrackerBackend(), "t.py::t")
    meter = GpuMem(measured, advise)
    measured.begin()
    model, opt, _ = _stack_step()
    x = torch.randn(B, D)
    phase = meter.phase  # bound before advise runs

    def step() -> None:
        with phase("forward"):
            loss = model(x).sum()
        loss.backward()
        opt.step()

    meter.advise(step, model=model, optimizer=opt, strategies=["checkpoint-blocks", "fused-step"])
    measured.end()
    assert "forward" not in measured.phases


def test_a_meter_made_without_advise_refuses_it_in_one_line() -> None:
    """Advise sits above measuring: the meter runs it only when given it (the fixture gives it)."""
    model, opt, step = _stack_step()
    meter = GpuMem(Measurement(TrackerBackend(), "t.py::t"))
    with pytest.raises(GpuMemError, match=r"^gpumem.advise\(\) runs strategies only for a meter given its advisor "):
        meter.advise(step, model=model, optimizer=opt)


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("model", [nn.Parameter(torch.ones(2, 3))] * 3, "a list of 3 (a Parameter of float32[2, 3], a Parameter of"),
        ("optimizer", nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "got a Sequential module"),
        ("loss", torch.ones(4, 5), "got a Tensor of float32[4, 5]"),
        ("batch_size", torch.ones(2), "got a Tensor of float32[2]"),
        ("capacity", nn.Linear(2, 2), "got a Linear module"),
        ("strategies", ["fused-step", nn.Linear(2, 2)], "got a Linear module in it"),
        ("strategies", ["no\nsuch " * 30], "no strategy 'no\\nsuch no\\nsuch no"),
    ],
)
def test_a_refused_argument_is_named_in_one_short_line(option: str, value: object, said: str) -> None:
    model, opt, step = _stack_step()
    options: dict[str, Any] = {"model": model, "optimizer": opt, option: value}
    with pytest.raises(GpuMemError) as refused:
        _tracked(lambda be: advise(step, backend=be, **options))
    message = str(refused.value)
    assert ("\n" not in message and said in message and option in message) or "strategy" in message
    assert len(message) < 300, message


def test_a_strategy_is_stacked_only_on_a_peak_it_lowered_alone() -> None:
    """The stack peaks in the optimizer step; checkpointing lowered only forward and backward, so it is not
    tried on it; a fused step has no step phase left, and a phase as-is lacks cannot be judged."""
    phases = (PhasePeak("forward", 50, 50), PhasePeak("backward", 80, 80), PhasePeak("step", 90, 90))
    base = Row(AS_IS, "", (), peak_bytes=90, phases=phases)
    ckpt = Row("ckpt", "", (), peak_bytes=90, phases=(PhasePeak("forward", 20, 20), *phases[1:]))
    fused = Row("fused", "", (), peak_bytes=80, phases=phases[:2])
    assert not ckpt.lowers(base, "step") and ckpt.lowers(base, "forward")
    assert fused.lowers(base, "step") and ckpt.lowers(base, None)


def test_what_advise_cached_past_a_lifted_capacity_does_not_serve_the_test() -> None:
    """advise lifts the capacity for its runs; on the allocator's model a 4 MiB tensor takes a 20 MiB
    segment, which must not stay cached for the test's own 4 MiB past its 8 MiB capacity."""
    backend = TrackerBackend("cuda")
    backend.configure(Settings(8 * 2**20, origins=False, events=False))
    measured = Measurement(backend, "t.py::t")
    meter = GpuMem(measured, advise)
    measured.begin()
    model, opt, step = _stack_step()

    def step_with_a_buffer() -> None:
        torch.ones(2**20).sum()
        step()

    try:
        meter.advise(step_with_a_buffer, model=model, optimizer=opt, strategies=["fused-step"])
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(2**20)
    finally:
        measured.end_if_running()


# --- advise measured as separate processes would (issue 39) ----------------------------------------------

MIB = 2**20
ROWS, WIDE = 16384, 256  # a 16 MiB activation (ROWS x WIDE float32) and a 256 KiB weight (WIDE x WIDE)


def _meta_tracked(fn: Callable[[TrackerBackend], Any]) -> Any:
    """On meta with the allocator's model, no cuBLAS workspace: every figure comes from the step's tensors."""
    backend = TrackerBackend(device="meta")
    backend.workspace_bytes = 0
    backend.start()
    try:
        return fn(backend)
    finally:
        backend.stop()


def _linear_pairs(blocks: int) -> nn.Module:
    pairs = [nn.Sequential(nn.Linear(WIDE, WIDE, bias=False), nn.Linear(WIDE, WIDE, bias=False)) for _ in range(blocks)]
    return nn.Sequential(*pairs).to("meta")


def test_each_row_reserves_from_the_cache_that_only_what_is_live_holds() -> None:
    """8 blocks of two WIDE x WIDE linears on ROWS rows: every activation is one 16 MiB block, which takes a
    16 MiB segment of its own and is reused exactly, so the large segments a run reserves are the most
    activations it holds at once; the 16 weight gradients (256 KiB) fill two 2 MiB small segments."""
    act, small = ROWS * WIDE * F4, 2 * 2 * MIB
    model = _linear_pairs(8)
    x, seed = torch.empty(ROWS, WIDE, device="meta"), torch.empty(ROWS, WIDE, device="meta")

    def step() -> None:
        model(x).backward(seed)

    advice: Advice = _meta_tracked(lambda be: advise(step, model=model, backend=be, strategies=["checkpoint-blocks"]))
    # as-is: 16 activations at the end of forward (each linear's output), then backward's first input gradient
    assert advice.as_is.reserved_bytes == 17 * act + small
    # checkpointed: at most the 8 block outputs (7 saved as block inputs, the last the step's output), the
    # last block's first linear's output recomputed, and the input gradient of its second linear; before
    # the fix the row reported the 17 activations' segments that as-is left cached
    row = advice.row("checkpoint-blocks")
    assert row.reserved_bytes == 10 * act + small
    assert advice.live_bytes == 16 * WIDE * WIDE * F4  # the weights, made before the tracker observed
    # it holds 164 MiB reserved; its absolute peak (4 MiB of weights, 10 activations and a few weight
    # gradients of 256 KiB) is under 165 MiB; as-is holds 276 MiB
    assert advice.best(165 * MIB) is row


class MlpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))  # type: ignore[no-any-return]


class Mlp(nn.Module):
    """Embedding, residual MLP blocks and a cross-entropy head: activations, logits and AdamW's step all
    weigh, so stacking moves the peak from phase to phase."""

    def __init__(self, blocks: int, width: int = 128, vocab: int = 4096) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(MlpBlock(width) for _ in range(blocks)))
        self.head = Head(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)), targets)  # type: ignore[no-any-return]


def _advise_mlp(blocks: int, names: list[str] | None, tokens: int = 1024) -> Advice:
    model = Mlp(blocks).to("meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.zeros(tokens, dtype=torch.long, device="meta")

    def step(batch: slice = slice(None)) -> None:
        model(ids[batch], ids[batch]).backward()
        opt.step()
        opt.zero_grad()

    found: Advice = _meta_tracked(
        lambda be: advise(
            step, model=model, optimizer=opt, backend=be, loss=model.head, batch_size=tokens, strategies=names
        )
    )
    return found


def _stacked(advice: Advice) -> list[Row]:
    return [r for r in advice.rows if len(r.strategies) > 1]


def test_every_strategy_tried_stacks_those_that_save_and_retries_the_rest_where_the_stack_peaks() -> None:
    advice = _advise_mlp(4, None)
    stacked = _stacked(advice)
    assert [r.name for r in stacked] == [
        "selective-checkpoint + micro-batch-2",
        "selective-checkpoint + micro-batch-2 + chunked-ce",
        "selective-checkpoint + micro-batch-2 + chunked-ce + foreach-off",
    ]
    # each kept on the stack lowered its peak; the stack became step-bound, where foreach-off (which alone
    # saved nothing: as-is peaks in backward) lowers it
    peaks = [row.peak_bytes or 0 for row in (advice.row("selective-checkpoint"), *stacked)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert stacked[1].peak_phase == "step" and advice.row("foreach-off").saving_bytes == 0


def test_a_stack_that_became_step_bound_tries_the_fused_step_which_alone_saved_nothing() -> None:
    advice = _advise_mlp(4, ["checkpoint-blocks", "chunked-ce", "fused-step"])
    assert advice.row("fused-step").saving_bytes == 0  # as-is peaks in backward, at the logits
    two, three = _stacked(advice)
    assert (two.name, two.peak_phase) == ("chunked-ce + checkpoint-blocks", "step")
    assert three.name == "chunked-ce + checkpoint-blocks + fused-step" and three.peak_phase == "backward"
    assert (three.peak_bytes or 0) < (two.peak_bytes or 0)
    assert advice.best(advice.held(three)) is three


def test_micro_batches_and_selective_recompute_cost_op_calls_where_they_cost_no_flops() -> None:
    """Selective recompute runs each block's GELU and residual add again (no FLOPs in torch's formulas);
    micro-batches run every op once per slice."""
    advice = _advise_mlp(2, ["selective-checkpoint", "micro-batch-2", "checkpoint-blocks"])
    for name in ("selective-checkpoint", "micro-batch-2"):
        row = advice.row(name)
        assert row.extra_flops == 0 and (row.extra_calls or 0) > 0
        assert re.fullmatch(r"no extra FLOPs, \+\d+% op calls", advice.compute(row)), advice.compute(row)
    assert re.fullmatch(r"\+\d+% FLOPs, \+\d+% op calls", advice.compute(advice.row("checkpoint-blocks")))
    assert advice.compute(advice.as_is) == "no extra compute"


def test_compute_names_op_calls_beside_flops_and_best_breaks_a_flops_tie_on_them() -> None:
    base = Row(AS_IS, "", (), peak_bytes=100, flops=1000, extra_flops=0, calls=200, extra_calls=0)
    micro = dataclasses.replace(_row("micro", 60, 0), calls=400, extra_calls=200)
    fused = dataclasses.replace(_row("fused", 70, 0), calls=230, extra_calls=30)
    ckpt = dataclasses.replace(_row("ckpt", 50, 100), calls=250, extra_calls=50)
    old = _row("old", 80, 0)  # advice written before calls were counted
    advice = Advice((base, micro, fused, ckpt, old), None, 0, "tracker", "cpu")
    assert advice.compute(micro) == "no extra FLOPs, +100% op calls"
    assert advice.compute(ckpt) == "+10% FLOPs, +25% op calls"
    assert advice.compute(old) == "no extra compute"
    # the same FLOPs: fewest extra op calls first (unknown counts as none); then FLOPs before op calls
    assert advice.best(85) is old and advice.best(75) is fused and advice.best(65) is micro
    assert advice.best(55) is ckpt
    assert Advice.from_json(advice.to_json()) == advice


def test_bf16_autocast_on_meta_runs_under_cudas_autocast_rules() -> None:
    """Linear(WIDE, WIDE) on ROWS rows under CUDA's autocast: mm casts its input and the weight (cached)
    to bf16 and makes a bf16 output; fp32 makes only its fp32 output."""
    model = nn.Linear(WIDE, WIDE, bias=False).to("meta")
    x = torch.empty(ROWS, WIDE, device="meta")
    seeds = {dtype: torch.empty(ROWS, WIDE, device="meta", dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}

    def step() -> None:
        out = model(x)
        out.backward(seeds[out.dtype])

    advice: Advice = _meta_tracked(lambda be: advise(step, model=model, backend=be, strategies=["bf16-autocast"]))
    row, bf16 = advice.row("bf16-autocast"), 2
    assert row.description == "bf16 autocast of the model's forward (CUDA's autocast rules)"
    assert advice.as_is.region_peak("forward") == ROWS * WIDE * F4
    assert row.region_peak("forward") == row.peak_bytes == 2 * ROWS * WIDE * bf16 + WIDE * WIDE * bf16
    assert row.precision == "bfloat16" and row.gradients == "not checked (meta: no data)"
