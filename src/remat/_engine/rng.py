"""Capture and replay the forward's random and autocast state (engine).

A region's recomputation must draw the same dropout masks and run under the
same autocast settings as its forward. `capture` records both before the
forward; `Replay.context` restores them around the recomputation and
leaves the caller's random state untouched afterwards.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from remat._engine.state import note_allocation


class DefaultDeviceType:
    """The accelerator type a region records autocast state for when no argument is on one.

    Same as ``torch.utils.checkpoint.DefaultDeviceType``: a region whose tensor
    arguments are all on the CPU still replays this device type's autocast
    settings (its forward may run there). The default is the current
    accelerator's type, or ``"cpu"`` without one.

    Examples:
        >>> import remat
        >>> previous = remat.DefaultDeviceType.get_device_type()
        >>> remat.DefaultDeviceType.set_device_type("cpu")
        >>> remat.DefaultDeviceType.get_device_type()
        'cpu'
        >>> remat.DefaultDeviceType.set_device_type(previous)
    """

    _default_device_type: str | None = None

    @staticmethod
    def set_device_type(device: str = "cuda") -> None:
        """Set the default device type (``"cuda"``, ``"xpu"``, ...)."""
        DefaultDeviceType._default_device_type = device

    @staticmethod
    def get_device_type() -> str:
        """Return the default device type."""
        if not DefaultDeviceType._default_device_type:
            accelerator = torch.accelerator.current_accelerator(True)
            DefaultDeviceType._default_device_type = accelerator.type if accelerator else "cpu"
        return DefaultDeviceType._default_device_type


def _devices_of(args: Any) -> tuple[str, list[int]]:
    """Return the accelerator type and device indices of the tensors in ``args``."""
    leaves = args if isinstance(args, list) and all(isinstance(a, torch.Tensor) for a in args) else (
        pytree.tree_leaves(args))  # a region's flat tensor arguments: no pytree
    device_type, indices = "cpu", []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and not leaf.is_cpu and not leaf.is_meta:
            device_type = leaf.device.type
            index = leaf.device.index if leaf.device.index is not None else 0
            if index not in indices:
                indices.append(index)
    return device_type, indices


def _autocast_state(device_type: str) -> tuple | None:
    """``(enabled, dtype, cache_enabled)`` of autocast on ``device_type``; None where it has none."""
    if device_type != "cpu" and not torch.amp.is_autocast_available(device_type):
        return None
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


class Replay:
    """What a region's forward ran under: random state and autocast settings.

    ``cpu_rng``, ``device_rng``: the generators' states (None: not preserved);
    ``cpu_autocast``, ``device_autocast``: `_autocast_state` of each device type.
    """

    __slots__ = ("cpu_autocast", "cpu_rng", "device_autocast", "device_rng", "device_type", "devices")

    def __init__(self, device_type: str, devices: list[int], cpu_rng: torch.Tensor | None,
                 device_rng: list[torch.Tensor] | None, cpu_autocast: tuple | None,
                 device_autocast: tuple | None) -> None:
        self.device_type, self.devices, self.cpu_rng, self.device_rng = device_type, devices, cpu_rng, device_rng
        self.cpu_autocast, self.device_autocast = cpu_autocast, device_autocast

    def context(self) -> _Replaying:
        """Run the enclosed code under the forward's random and autocast state.

        An autocast state equal to the one in force already is not entered again (entering
        it would change nothing but cost a context per re-run)."""
        return _Replaying(self)


class _Replaying:
    """`Replay.context`: the random state forked and set to the forward's, the forward's
    autocast entered where it differs from the one in force; a class, not a generator
    (every re-run enters one)."""

    __slots__ = ("autocast", "module", "replay", "states")

    def __init__(self, replay: Replay) -> None:
        self.replay, self.module, self.states, self.autocast = replay, None, None, None

    def __enter__(self) -> None:
        replay = self.replay
        if replay.cpu_rng is not None:  # as torch.random.fork_rng, its snapshot shown to the memory tools
            self.states = [torch.get_rng_state()]
            note_allocation(self.states[0])
            if replay.device_rng is not None and replay.devices:
                self.module = torch.get_device_module(replay.device_type)
                self.states += [self.module.get_rng_state(d) for d in replay.devices]
            torch.set_rng_state(replay.cpu_rng)
            if replay.device_rng is not None:
                module = torch.get_device_module(replay.device_type)
                for index, state in zip(replay.devices, replay.device_rng):
                    module.set_rng_state(state, index)
        try:
            if replay.cpu_autocast is not None and replay.cpu_autocast != _autocast_state("cpu"):
                self._enter_autocast("cpu", replay.cpu_autocast)
            if (replay.device_autocast is not None and replay.device_type != "cpu"
                    and replay.device_autocast != _autocast_state(replay.device_type)):
                self._enter_autocast(replay.device_type, replay.device_autocast)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _enter_autocast(self, device_type: str, settings: tuple) -> None:
        enabled, dtype, cache_enabled = settings
        context = torch.amp.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)
        context.__enter__()
        if self.autocast is None:
            self.autocast = []
        self.autocast.append(context)

    def __exit__(self, *exc_info: object) -> None:
        autocast, self.autocast = self.autocast, None
        try:
            while autocast:
                autocast.pop().__exit__(*exc_info)
        finally:
            states, self.states = self.states, None
            if states is not None:
                torch.set_rng_state(states[0])
                for device, state in zip(self.replay.devices, states[1:]):
                    self.module.set_rng_state(state, device)


_ON_CPU = operator.attrgetter("is_cpu")


def capture(args: Any, preserve_rng_state: bool) -> Replay:
    """Record the random and autocast state a region's forward is about to run under.

    Args:
        args: the region's arguments; the devices of their tensors are recorded.
        preserve_rng_state: record the random state (False: recomputation draws anew).

    Returns:
        A `Replay` whose ``context()`` restores that state.
    """
    cpu_rng = torch.get_rng_state() if preserve_rng_state else None
    if cpu_rng is not None:
        note_allocation(cpu_rng)
    default = DefaultDeviceType._default_device_type or DefaultDeviceType.get_device_type()
    if default == "cpu" and isinstance(args, list) and all(map(_ON_CPU, args)):  # the usual CPU case
        return Replay("cpu", [], cpu_rng, None, _autocast_state("cpu"), None)
    device_type, devices = _devices_of(args)
    if not devices and default not in ("cpu", "meta"):
        device_type = default  # autocast only: no device to seed
    device_rng = None
    if device_type != "cpu":
        module = torch.get_device_module(device_type)
        if preserve_rng_state and getattr(module, "_initialized", True):
            device_rng = [module.get_rng_state(i) for i in devices]
    return Replay(device_type, devices, cpu_rng, device_rng, _autocast_state("cpu"),
                  _autocast_state(device_type) if device_type != "cpu" else None)


def generator_states(tensors: Any) -> list[torch.Tensor]:
    """The states of the generators an operator on ``tensors`` may draw from: the CPU's
    default one, and that of each CUDA device among them (NOTE [Kept random operators] in
    ``selective.py``: whether a random operator drew is whether these changed across it).
    Read outside every dispatch mode: no tracker counts them, no fake-tensor mode fakes them."""
    devices = sorted({t.device.index or 0 for t in pytree.tree_leaves(tensors)
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with _disable_current_modes():
        return [torch.random.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


def drew(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    """Whether any generator's state changed between two `generator_states`."""
    with _disable_current_modes():
        return len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
