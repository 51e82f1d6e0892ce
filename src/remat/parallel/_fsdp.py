"""``parallel_optimizer_comm_recompute`` on FSDP2 units under a mark (front end).

NOTE [Sharded parameters under a mark]
MindSpore's parallel optimizer shards parameters and all-gathers them before
use; ``parallel_optimizer_comm_recompute`` says whether a recomputed cell
all-gathers them again for its recomputation (True) or keeps the gathered
parameters from forward (False, MindSpore's default). FSDP2's
``fully_shard`` is the same machine and its ``reshard_after_forward`` the
same switch, set per FSDP unit: True frees the gathered parameters after the
unit's forward and gathers them again in backward, before the recomputation
needs them; False keeps them gathered until the unit's backward.

So a mark that *passes* the option sets ``reshard_after_forward`` of every
FSDP unit at or under the marked module, the first time the module runs
forward under that mark (a mark set again with the same options is the same mark:
NOTE [A mark set again is the same mark] in ``_front/marks.py``). A mark that does
not pass it leaves FSDP2's own choice alone: FSDP2 already reshards every unit but the root after forward,
which is what sharding is for (MindSpore's False would hold every gathered
parameter of every recomputed cell from forward to backward, the full model
on every rank); remat does not override a decision the user made when
calling ``fully_shard``. The setting applies to whole units: a mark that
covers only a part of a unit (some of its parameters, not its root) cannot
apply it, and warns.

NOTE [Output pass over FSDP units]
A chain of ``output_recompute`` regions rebuilds a region's outputs by
re-running it in backward, for the next region's recomputation (NOTE
[Output pass]). FSDP2 does not reshard a unit whose forward runs inside
backward (it expects activation checkpointing to re-run a unit only for its
own backward), so every unit of the chain would stay gathered at once. remat
reshards a unit right after such a run when the unit reshards after forward
and its own backward has not begun: units are gathered one at a time, and a
unit is gathered once more when its own backward comes. A re-run calls the
marked module's ``forward`` without the module's hooks (NOTE [Hooks of a marked
module]), FSDP's among them, so when the marked module is itself a unit,
`gathered_for_rerun` gathers it for the re-run and frees it after, as its
hooks would.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from remat._engine.boundary import add_refill_check
from remat._engine.state import is_recomputing
from remat._front.marks import add_run_context
from remat._vocab.spec import RegionSpec

#: module -> the mark whose setting was applied to its units; kept outside the module's
#: ``__dict__``, whose keys and identities a region's tree compares (NOTE [Snapshots reused
#: while nothing changed] in ``_engine/tree.py``): a key set by the first call changed the tree
_APPLIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOKED = "_remat_fsdp_output_pass"


def apply_to_units(module: torch.nn.Module, spec: RegionSpec) -> None:
    """Set ``reshard_after_forward`` of the FSDP2 units under ``module`` from its mark, once."""
    value = spec.parallel_optimizer_comm_recompute
    if (value is None and not spec.output_recompute) or _APPLIED.get(module) is spec:
        return
    _APPLIED[module] = spec
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # nothing was sharded in this process
        return
    units = [m for m in module.modules() if isinstance(m, fsdp.FSDPModule)]
    for unit in units:
        if value is not None:
            unit.set_reshard_after_forward(value, recurse=False)
        if spec.output_recompute and not unit.__dict__.get(_HOOKED):
            unit.__dict__[_HOOKED] = True
            unit.register_forward_hook(_reshard_after_output_pass)
    partial = _units_covered_in_part(module, units) if value is not None else []
    if partial:
        warnings.warn(
            f"remat: {type(module).__name__} is marked with parallel_optimizer_comm_recompute="
            f"{value} but covers only part of the FSDP unit(s) {', '.join(partial)}; the setting "
            f"applies per unit (reshard_after_forward), so it is not applied to them; mark the "
            f"unit's root module or call fully_shard on the marked module",
            UserWarning,
            stacklevel=3,
        )


def _units_covered_in_part(module: torch.nn.Module, units: list) -> list[str]:
    """Names of the FSDP units outside ``module`` that own some of its parameters."""
    from torch.distributed._composable_state import _module_state_mapping

    inside = set(module.modules())
    found = []
    for owner, state_ref in list(_module_state_mapping.items()):
        state = state_ref()
        if owner in inside or state is None or owner in units:
            continue
        for group in getattr(state, "_fsdp_param_groups", ()):
            if any(p._module_info.module in inside for p in group.fsdp_params):
                found.append(type(owner).__name__)
                break
    return found


def _reshard_after_output_pass(unit: Any, args: Any, output: Any) -> None:
    """NOTE [Output pass over FSDP units]: free a unit gathered for another region's recomputation."""
    if torch._C._current_graph_task_id() == -1:
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = unit._get_fsdp_state()
    if state._training_state == TrainingState.PRE_BACKWARD:
        return  # its own backward: FSDP reshards after it
    if any(g.post_forward_mesh_info is not None for g in state._fsdp_param_groups):
        unit.reshard()


def run_context(module: torch.nn.Module, spec: RegionSpec) -> contextlib.AbstractContextManager | None:
    """Around each run of a marked module: its units' resharding set, a re-run gathered;
    None while nothing in this process was sharded (no FSDP module exists).

    Registered with the marks (NOTE [Call guards] in ``_front/marks.py``); NOTE [Sharded
    parameters under a mark], NOTE [Output pass over FSDP units].
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    apply_to_units(module, spec)
    if not isinstance(module, fsdp.FSDPModule) or not is_recomputing():
        return None  # (entered right after it is made: the same holds then)
    return gathered_for_rerun(module)


@contextlib.contextmanager
def gathered_for_rerun(module: torch.nn.Module) -> Iterator[None]:
    """While remat re-runs a marked FSDP2 unit's forward, hold its parameters gathered.

    NOTE [Output pass over FSDP units]. Outside recomputation, or for a module that
    is not an FSDP unit, this does nothing.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, fsdp.FSDPModule) or not is_recomputing():
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = module._get_fsdp_state()
    own_backward = state._training_state == TrainingState.PRE_BACKWARD
    module.unshard()  # no collective when FSDP already gathered it for this backward
    try:
        yield
    finally:
        if not own_backward and any(
            g.post_forward_mesh_info is not None for g in state._fsdp_param_groups
        ):
            module.reshard()


def _fsdp_refills() -> bool:
    """Whether FSDP2 units exist in this process: they gather into the same parameters for
    backward (NOTE [Parameters changed before backward] in ``_engine/boundary.py``)."""
    states = sys.modules.get("torch.distributed._composable_state")
    return states is not None and bool(states._module_state_mapping)


add_run_context(run_context)  # NOTE [Call guards]: the mark's core imports no adapter
add_refill_check(_fsdp_refills)
