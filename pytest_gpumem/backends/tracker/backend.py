"""The tracker backend: exact bytes of the tensor storages that ATen ops create, for machines without a GPU.

It puts the pieces together for each measurement: the ledger (`ledger`) that counts the storages, the
dispatch mode (`mode`) that tells it of each op's outputs, the patches (`patches`) for what the mode
cannot see, and on request a recorder of origins and events (`recording`) or an attributor (`attribution`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from cuda_allocator_model import (
    CUBLAS_WORKSPACE_DEFAULT,
    AllocatorSettings,
    cublas_workspace_bytes,
    find_card,
    format_size,
)
from pytest_gpumem.backends.base import Backend, Counters, Settings
from pytest_gpumem.backends.timeline import Timeline, TimelineRecorder
from pytest_gpumem.backends.tracker import cudnn
from pytest_gpumem.backends.tracker.allocator_state import SavedAllocator, copied
from pytest_gpumem.backends.tracker.compiled_notes import compiled_note, fake_outputs_note
from pytest_gpumem.backends.tracker.ledger import StorageLedger
from pytest_gpumem.backends.tracker.mode import leave, mode_class
from pytest_gpumem.backends.tracker.patches import Patches
from pytest_gpumem.constants import PATHS, ROUNDINGS
from pytest_gpumem.errors import from_the_model
from pytest_gpumem.results.baseline import DeviceIdentity

if TYPE_CHECKING:
    import torch

    from pytest_gpumem.backends.tracker.attribution import Attributor
    from pytest_gpumem.backends.tracker.recording import Origin, Survivor


def _out_of_memory() -> type[Exception]:
    import torch

    return torch.OutOfMemoryError


def _default_paths(rounding: str, device: str) -> str:
    """A GPU's code paths where the run predicts a GPU (the meta device, CUDA rounding), else the CPU's."""
    return "gpu" if device == "meta" or rounding == "cuda" else "cpu"


def stop_counting(mode: Any, ledger: StorageLedger, undo: Callable[[], None] = lambda: None) -> None:
    """End a measurement: take the tracker's `mode` off (if on) and, even if that fails, remove the
    attributor's hooks, `undo` what else was installed, and forget the ledger's storages and recorder
    (its events were read before the stop)."""
    from pytest_gpumem.backends.tracker.attribution import Attributor

    try:
        if mode is not None:
            leave(mode)
    finally:
        if isinstance(ledger.recorder, Attributor):
            ledger.recorder.remove()
        undo()
        ledger.forget()
        ledger.recorder = None


class TrackerBackend(Backend):
    """Counts tensor storages on any device; `rounding="cuda"` predicts the CUDA allocator's counts."""

    name = "tracker"
    sees_earlier_allocations = False
    caps_the_process = records_events = caps_a_block = True

    def __init__(self, rounding: str = "auto", device: str = "cpu", paths: str | None = None) -> None:
        if rounding == "auto":
            rounding = "cuda" if device == "meta" else "none"
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if device not in ("cpu", "meta"):
            raise ValueError(f"device must be cpu or meta, got {device!r}")
        if paths is not None and paths not in PATHS:
            raise ValueError(f"paths must be one of {PATHS}, got {paths!r}")
        self.rounding = rounding
        # PYTORCH_CUDA_ALLOC_CONF is the allocator model's: a run without it ignores a GPU job's settings
        with from_the_model():
            self.allocator = AllocatorSettings.from_environ(os.environ) if rounding == "cuda" else AllocatorSettings()
        self._device_type = device
        self._default_paths = _default_paths(rounding, device)
        self.paths = paths or self._default_paths
        mode_class()  # its imports (Dynamo's) happen now, not inside the first test's call
        self.ledger = StorageLedger(rounding, out_of_memory=_out_of_memory(), settings=self.allocator)
        self.ledger.device_type = "meta" if device == "meta" else None  # a CPU tensor is the GPU's host memory
        self.predict_card(None)
        self._mode: Any = None
        self._patches: Patches | None = None
        self._notes: list[str] = []

    @property
    def _predicting(self) -> bool:
        """Whether the figures stand for a card's: on meta, or served by the CUDA allocator's model."""
        return self._device_type == "meta" or self.rounding == "cuda"

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device(self._device_type)

    def identity(self) -> DeviceIdentity:
        """What baselines are keyed by: rounding changes every figure, so it is part of the backend, and
        a meta run is a prediction that never mixes with measured figures."""
        paths = "" if self.paths == self._default_paths else f"{self.paths} paths"
        settings = [s for s in ("meta" if self._device_type == "meta" else "", self._rounding_text(), paths) if s]
        backend = "tracker" if not settings else f"tracker ({', '.join(settings)})"
        return DeviceIdentity(backend, self._device_type)

    def _rounding_text(self) -> str:
        if self.rounding == "none":
            return ""
        settings = self.allocator.describe()
        workspace = self.ledger.workspace_bytes
        if workspace != CUBLAS_WORKSPACE_DEFAULT:  # a card's or CUBLAS_WORKSPACE_CONFIG's: other figures
            settings = f"{settings} cuBLAS workspace {format_size(workspace)}".strip()
        return f"round {self.rounding}" + (f" {settings}" if settings else "")

    def predict_card(self, card: str | None) -> None:
        """From the next allocation on, predict the card called `card` (None: no card named): with the
        allocator's model, its cuBLAS workspaces have the size torch gives its compute capability, or
        `CUBLAS_WORKSPACE_CONFIG`'s, as the GPU job's would (read now)."""
        modelled = self.rounding == "cuda"  # the environment is read only where the model makes workspaces
        with from_the_model():
            found = None if card is None else find_card(card)
            capability = None if found is None else found.capability
            self.ledger.workspace_bytes = cublas_workspace_bytes(capability, os.environ if modelled else None)
        self._on_card(None if found is None else found.total)
        self.ledger.card = found

    def _on_card(self, total: int | None) -> None:
        """The allocator's settings on a card of `total` bytes, what per_process_memory_fraction takes a
        fraction of (None: no card named), from the next allocation on."""
        self.ledger.settings = self.ledger.settings.on_card(total)
        if self.ledger.model is not None:
            self.ledger.model.settings = self.ledger.model.settings.on_card(total)

    @property
    def workspace_bytes(self) -> int:
        """The bytes of each cuBLAS workspace the allocator's model makes: the predicted card's."""
        return self.ledger.workspace_bytes

    @workspace_bytes.setter
    def workspace_bytes(self, size: int) -> None:
        self.ledger.workspace_bytes = size

    @property
    def largest_kernel_temporaries(self) -> int:
        """The most bytes one op's modelled kernel temporaries (`kernel_temporaries`) held at once in the
        measurement under way; 0 where none were modelled."""
        return self.ledger.largest_temporaries

    @contextlib.contextmanager
    def predicting(self, card: str | None) -> Iterator[None]:
        """Within the block, predict `card` (`predict_card`); then the card predicted before again."""
        before, total, card_before = self.ledger.workspace_bytes, self.ledger.settings.card_total, self.ledger.card
        self.predict_card(card)
        try:
            yield
        finally:
            self.ledger.workspace_bytes = before
            self._on_card(total)
            self.ledger.card = card_before

    def clear_workspaces(self) -> None:
        """`private_torch.clear_cublas_workspaces()`: the model's cuBLAS workspaces are freed (a kept
        workspace is the allocator's, not the test's: the call's end does this before its last reading)."""
        self.ledger.clear_workspaces()

    def describe(self) -> str:
        device = "meta (a prediction: sizes without data, nothing computed)" if self._device_type == "meta" else "cpu"
        served = "rounding none"
        if self.rounding == "cuda":
            settings = self.allocator.describe(limits=True)
            served = "served by a model of the CUDA caching allocator" + (f", {settings}" if settings else "")
        line = f"tracker (storages created by ATen ops, {served}), device {device}"
        if self._predicting:
            line += "; compiled: Inductor's partition, unfused (an upper bound), other backends as chosen"
        return line + self._paths_text() if self._predicting or self.paths == "gpu" else line

    def _paths_text(self) -> str:
        meta = self._device_type == "meta"
        if self.paths == "cpu":
            attention = ", math attention (S x S weights)" if meta else ""
            return f"; the CPU's code paths: single-tensor optimizers{attention} (--gpumem-paths=gpu for a GPU's)"
        attention = ", fused attention" if meta else ""
        return (
            f"; a GPU's code paths: foreach optimizers{attention}, CUDA's autocast (--gpumem-paths=cpu for the CPU's)"
        )

    def start(self) -> None:
        tracking_mode = mode_class()
        self.ledger.forget()
        self._notes = []
        self._patches = Patches(tracking_mode, self._notes)
        gpu = self.paths == "gpu"
        meta = self._device_type == "meta"
        attribution = self.attribution()
        self._patches.install(
            foreach=gpu,
            fused_attention=gpu and meta,
            allocator=self.rounding == "cuda",
            meta=meta,
            cuda_autocast=self._device_type if gpu else None,
            unfused_compiled=self._predicting,
            after_backward=None if attribution is None else attribution.backward_ran,
        )
        self._mode = tracking_mode(self.ledger)
        try:
            if attribution is not None:
                attribution.install()
            self._mode.__enter__()
        except BaseException:
            self._mode = None
            if attribution is not None:
                attribution.remove()
            self._patches.undo()
            raise

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        stop_counting(mode, self.ledger, self._undo_patches)

    def _undo_patches(self) -> None:
        if self._patches is not None:
            self._patches.undo()
        self._notes += fake_outputs_note(self.ledger.fake_outputs) + cudnn.notes(self.ledger.bounds)
        if self._predicting:
            self._notes += compiled_note(self._patches, self.ledger.compiled_buffers)

    @property
    def capacity(self) -> int | None:
        """The bytes past which an allocation raises OutOfMemoryError (`configure`); None: unlimited."""
        return self.ledger.capacity

    def notes(self) -> list[str]:
        """What the last measurement could not see, one sentence each."""
        return list(self._notes)

    def configure(self, settings: Settings) -> None:
        """For the next measurement: a device of `capacity` bytes (None: unlimited); record where each
        storage came from (`origins`), the sequence of allocations and frees (`events`), and what each
        storage is for and which module made it (`explain`)."""
        from pytest_gpumem.backends.tracker.attribution import Attributor
        from pytest_gpumem.backends.tracker.recording import Recorder

        self.ledger.capacity = settings.capacity
        if settings.explain:
            self.ledger.recorder = Attributor(self.ledger.live, settings.events, allocator=self.ledger)
        else:
            recording = settings.origins or settings.events
            self.ledger.recorder = Recorder(settings.events) if recording else None

    @contextlib.contextmanager
    def held_to(self, capacity: int | None) -> Iterator[None]:
        """Within the block, an allocation past `capacity` bytes raises OutOfMemoryError, whatever was
        configured (`gpumem.fit` runs its answers on the card it asks about); None: none is held to
        (`gpumem.advise()` judges a capacity itself)."""
        before = self.ledger.capacity
        self.ledger.capacity = capacity
        try:
            yield
        finally:
            self.ledger.capacity = before

    def empty_cache(self) -> None:
        """Give back the allocator model's free segments (nothing without the model)."""
        self.ledger.empty_cache()

    def allocator_state(self) -> object | None:
        """A copy of the allocator model (its segments, blocks and cache) and the storages live in it."""
        model = self.ledger.model
        if model is None:
            return None
        return SavedAllocator(copied(model), {key: ref.counted for key, ref in self.ledger.live.items()})

    def start_afresh(self, state: object | None) -> None:
        """The allocator model as `state` holds it (its peaks kept), where the storages live now were all live
        then and it is served with the same settings (those freed since, such as gradients set to None, freed
        in it as a step's first frees); else the live storages placed anew in a model with no cache."""
        ledger, model = self.ledger, self.ledger.model
        if model is None:
            return
        kept = isinstance(state, SavedAllocator) and ledger.live.keys() <= state.counted.keys()
        if not kept or state.model.settings != ledger.settings:  # type: ignore[union-attr]
            self._place_anew(ledger.settings)
            return
        assert isinstance(state, SavedAllocator)
        restored = copied(state.model)
        for key in state.counted.keys() - ledger.live.keys():
            restored.free(key)
        for key, ref in ledger.live.items():
            ledger.allocated += state.counted[key] - ref.counted
            ref.counted = state.counted[key]
        restored.peak_reserved = max(restored.peak_reserved, model.peak_reserved)
        restored.peak_allocated = max(restored.peak_allocated, model.peak_allocated)
        restored.capacity = ledger.capacity
        ledger.model = restored

    def expandable_segments(self) -> contextlib.AbstractContextManager[None] | None:
        """A block within which the allocator's model has expandable segments, where it has none; the live
        storages are placed anew, in the order they were made, on the way in and out (the model's peaks kept)."""
        settings = self.ledger.settings
        if self.ledger.model is None or settings.expandable_segments:
            return None
        return self._served_with(dataclasses.replace(settings, expandable_segments=True))

    @contextlib.contextmanager
    def _served_with(self, settings: AllocatorSettings) -> Iterator[None]:
        before = self.ledger.settings
        self._place_anew(settings)
        try:
            yield
        finally:
            self._place_anew(before)

    def _place_anew(self, settings: AllocatorSettings) -> None:
        from cuda_allocator_model import CachingAllocatorModel

        ledger, old = self.ledger, self.ledger.model
        model = CachingAllocatorModel(settings)
        for ref in ledger.live.values():
            counted = model.malloc(ref.key, ref.requested)
            ledger.allocated += counted - ref.counted
            ref.counted = counted
        if old is not None:
            model.peak_reserved = max(model.peak_reserved, old.peak_reserved)
            model.peak_allocated = max(model.peak_allocated, old.peak_allocated)
        model.capacity = ledger.capacity
        ledger.settings, ledger.model = settings, model

    @contextlib.contextmanager
    def timeline(self) -> Iterator[Callable[[], Timeline]]:
        """Within the block, the bytes allocated after each allocation, resize and free, with the op and
        the source line of each allocation; the value given returns them after the block."""
        from pytest_gpumem.backends.tracker.recording import op_name, user_line

        before, recorder = self.ledger.timeline, TimelineRecorder(op_name, user_line)
        self.ledger.timeline = recorder
        try:
            yield recorder.timeline
        finally:
            self.ledger.timeline = before

    def attribution(self) -> Attributor | None:
        """The attributor of the measurement under way, when it explains its peaks."""
        from pytest_gpumem.backends.tracker.attribution import Attributor

        recorder = self.ledger.recorder
        return recorder if isinstance(recorder, Attributor) else None

    def survivors(self, count: int) -> list[Survivor]:
        """The largest storages the call made that are still allocated, with what they hold (an empty one,
        such as a Lazy module's uninitialized parameter, holds no memory and is none)."""
        from pytest_gpumem.backends.tracker.recording import Survivor, tensors_by_storage

        holding = (ref for ref in self.ledger.live.values() if ref.counted)
        refs = sorted(holding, key=lambda ref: ref.counted, reverse=True)[:count]
        tensors = tensors_by_storage({ref.key for ref in refs})
        found = []
        for ref in refs:
            tensor = tensors.get(ref.key)
            shape = None if tensor is None else tuple(tensor.shape)
            dtype = None if tensor is None else str(tensor.dtype).removeprefix("torch.")
            device = None if tensor is None else str(tensor.device)
            found.append(Survivor(ref.counted, shape, dtype, device, ref.origin))
        return found

    def live_storages(self) -> dict[int, tuple[int, Origin | None]]:
        """Each storage the call made that is still allocated, by key: its counted bytes and its origin."""
        return {ref.key: (ref.counted, ref.origin) for ref in self.ledger.live.values()}

    def trace(self) -> dict[str, Any] | None:
        """The allocations and frees of the measurement, when events were recorded."""
        recorder = self.ledger.recorder
        return None if recorder is None or recorder.events is None else recorder.trace()

    def settle(self) -> None:
        return None

    def current(self) -> Counters:
        return Counters(self.ledger.allocated, self.ledger.requested, self.ledger.reserved)

    def peak(self) -> Counters:
        return Counters(self.ledger.peak_allocated, self.ledger.peak_requested, self.ledger.peak_reserved)

    def reset_peak(self) -> None:
        self.ledger.reset_peak()
