"""What a region's re-run saves, handed to the forward's holders and checked against them (engine).

The saved-tensor hooks of a ``use_reentrant=False`` region's re-run (`RecomputeHooks`):
each tensor the re-run saves goes to the holder the forward made for it (NOTE [Rebuilt
tensors keep their version] in ``hooked.py``), until the last one still needed (NOTE
[Early stop]: `Stop`); then `check` compares the count and the metadata with what the
forward saved, as torch's checkpoint does (its three cases), and raises a
``RecomputeError`` that names the region, and with ``debug=True`` lists the operators run
in forward and in recomputation.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from remat._engine.errors import RecomputeError
from remat._engine.placeholder import Placeholder


def meta(x: torch.Tensor) -> tuple:
    """What the count check compares of a saved tensor: its shape, dtype and device."""
    return (tuple(x.shape), x.dtype, x.device)


def _show_meta(found: tuple) -> str:
    shape, dtype, device = found
    return f"shape {list(shape)}, {str(dtype).replace('torch.', '')}, {device}"


class Stop(Exception):
    """Raised inside a re-run once the last needed tensor is rebuilt (NOTE [Early stop])."""


def check(frame: Any, gid: object, stop_at: int | None, mismatches: list[str],
          during_forward: bool = False) -> None:
    """Compare what the re-run saved with what forward saved (torch's three cases)."""
    if frame.spec.determinism_check == "none":
        return
    count, saved = frame.counter[gid], len(frame.holders)
    lines = []
    if count < (saved if stop_at is None else stop_at + 1):
        lines.append("A different number of tensors was saved during the original forward "
                     "and recomputation.")
        lines.append(f"number of tensors saved during the original forward and recomputation: "
                     f"{saved} and {count}")
    elif count > saved and not during_forward:  # without early stop; NOTE [Backward inside a region's forward]
        lines.append(
            f"trying to save more tensors during recomputation than during the original "
            f"forward pass: forward saved {saved}, recomputation saved {count}"
        )
    if mismatches:
        lines.append(
            "Recomputed values for the following tensors have different metadata than "
            "during the forward pass:"
        )
        lines += mismatches
    if lines:
        raise RecomputeError(_mismatch_message(frame, lines))


def _mismatch_message(frame: Any, mismatches: list[str]) -> str:
    text = (
        f"remat: region '{frame.name}' rebuilt tensors that differ from the ones saved in "
        f"forward:\n  " + "\n  ".join(mismatches)
    )
    if frame.trace is not None and frame.recompute_trace is not None:
        return (
            f"{text}\n\nOperators run in forward:\n{frame.trace.render()}\n\n"
            f"Operators run in recomputation:\n{frame.recompute_trace.render()}\n\n"
            f"Detected non-determinism while running activation checkpointing. You are "
            f"seeing this error because you passed `debug=True` to checkpoint (or turned "
            f"debug on with set_checkpoint_debug_enabled(True)): compare the two lists above."
        )
    return text + (
        "\nPass debug=True to print the operators run in forward and in recomputation, or "
        "wrap the code in remat.set_checkpoint_debug_enabled(True)."
    )


class RecomputeHooks(torch.autograd.graph.saved_tensors_hooks):
    """Collect the tensors a re-run saves into the holders of the forward."""

    def __init__(self, frame: Any, gid: int, stop_at: int | None, mismatches: list,
                 store: bool, first: int = 0) -> None:
        # the re-run's graph holds this hook with every tensor it saves: a strong reference to
        # the frame would lead a tensor the re-run hands out (a hook's capture in a list the
        # frame's module state holds) back to the frame, a cycle the collector cannot free
        frame_ref = weakref.ref(frame)
        del frame

        def pack(x: torch.Tensor) -> torch.Tensor:
            frame = frame_ref()
            index = frame.counter[gid]
            frame.counter[gid] = index + 1
            if index < first:  # another stage's, which stores and checks its own (NOTE [Re-runs
                return None  # in stages]); the re-run's graph is never differentiated: hold nothing
            x = x.detach() if x.requires_grad else x  # NOTE [Inputs come back as themselves]
            if index >= len(frame.holders):
                return x
            if type(x) is Placeholder:  # NOTE [Placeholders keep the device]: never saved
                mismatches.append(f"tensor #{index}: recomputation saved the output of an operator "
                                  f"it skipped ({x!r}): the re-run reads otherwise than its forward")
            elif frame.metas and frame.metas[index] != meta(x):
                holder = frame.holders[index]()
                by = f" (saved by {holder.saved_by})" if holder is not None and holder.saved_by else ""
                mismatches.append(
                    f"tensor #{index}{by}: forward {_show_meta(frame.metas[index])}; "
                    f"recomputation {_show_meta(meta(x))}"
                )
            holder = frame.holders[index]() if store else None
            if holder is not None and holder.kept is None and gid not in holder.rebuilt:
                holder.rebuilt[gid] = (x, x._version)  # NOTE [Rebuilt tensors keep their version]
            if stop_at is not None and index >= stop_at:
                raise Stop
            return x

        super().__init__(pack, lambda x: x)


def refuse_expired(name: str, refused: bool = False) -> None:
    """A backward reached a region that let go of what its re-run needs: one made for another
    backward's re-run only (NOTE [Regions made inside a re-run] in ``region.py``), or one a
    refused backward never reached (``refused``, NOTE [Backward refused] in ``refusal.py``)."""
    if refused:
        raise RecomputeError(
            f"remat: region '{name}' belongs to a step whose backward remat refused (see the "
            f"first RecomputeError), and let go of what its re-run needs then; run the step "
            f"again, forward and backward"
        )
    raise RecomputeError(
        f"remat: region '{name}' was made inside another region's re-run, for that backward "
        f"only, and a later backward reached it (through a tensor a hook kept from the "
        f"re-run?); differentiate the tensors of the forward, not of its re-run"
    )


class Holder:
    """What a saved tensor of a ``use_reentrant=False`` region is packed into: the tensor kept,
    a weak probe of it, its argument (NOTE [Saved arguments are read back] in ``hooked.py``),
    or what the re-runs rebuilt, per graph task."""

    __slots__ = ("__weakref__", "argument", "argument_version", "index", "kept", "kept_version", "out_of",
                 "probe", "probe_version", "rebuilt", "recipe", "saved_by")

    def __init__(self, index: int) -> None:
        self.index = index
        self.kept: torch.Tensor | None = None
        self.kept_version = 0
        self.rebuilt: dict[int, tuple] = {}  # graph task -> (tensor, its version then, or None)
        self.probe: weakref.ref | None = None
        self.probe_version = -1  # the version it was saved at, while inputs may be written
        self.out_of: tuple | None = None  # (output index, layout) when it is an output
        self.saved_by: str | None = None
        self.argument: weakref.ref | None = None  # NOTE [Saved arguments are read back]
        self.argument_version = -1
        self.recipe: tuple[int, int] | None = None  # NOTE [Each saved tensor rebuilt on its own]

    def keep(self, x: torch.Tensor) -> None:
        self.kept, self.kept_version, self.probe = x.detach(), x._version, None

    def keep_as_saved(self, x: torch.Tensor) -> None:
        """Keep ``x`` late, at the version it was saved at (NOTE [Regions that write their
        inputs]): a write since then makes it stale, as autograd's own saved tensors are."""
        saved = self.probe_version
        self.keep(x)
        if saved >= 0:
            self.kept_version = saved

    def kept_is_stale(self) -> bool:
        return self.kept is not None and self.kept._version != self.kept_version


def changed_after_rebuilt(name: str, holder: Holder, x: torch.Tensor, version: int) -> str:
    """NOTE [Rebuilt tensors keep their version]."""
    return (
        f"remat: region '{name}' cannot be re-run exactly: saved tensor #{holder.index} "
        f"(shape {list(x.shape)}) was changed in place later in the same re-run (version "
        f"{version} when the re-run saved it, {x._version} now), as the forward changed it "
        f"after saving it, so its value is not the one the forward saved (one of the "
        f"variables needed for gradient computation has been modified by an inplace "
        f"operation); make that in-place operation out of place (inplace=False, x = x.relu() "
        f"for x.relu_()), or clone the tensor before it"
    )


def unpacked_twice(name: str, holder: Holder, grouped: bool) -> str:
    """A saved tensor unpacked a second time in one backward (or one ``GraphExecGroup``)."""
    if grouped:
        return (
            f"remat: region '{name}': saved tensor #{holder.index} is needed by two "
            f"backward calls in one GraphExecGroup, which re-runs the region once for all of "
            f"them. Unpack is being triggered for a tensor that was already unpacked once. "
            f"Performing two backward calls that overlap (i.e. require the same saved "
            f"activation in order to compute gradients) is not allowed while under the "
            f"torch.utils.checkpoint.GraphExecGroup context. Run the overlapping call "
            f"outside the group"
        )
    return (
        f"remat: region '{name}': saved tensor #{holder.index} was unpacked twice in one "
        f"backward. Unpack is being triggered for a tensor that was already unpacked once. "
        f"If you are calling ctx.saved_tensors in backward, make sure to do so only once"
    )
