"""What a mark asks for: the options of one recompute region (layer 1, no torch).

A `RegionSpec` is plain, frozen data. Marks on modules store one; the
engine reads one; the graph pass reads the same one. Nothing else carries
recompute options.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from remat._vocab.errors import check_bool
from remat._vocab.policy import Policy

DETERMINISM_CHECKS = ("default", "none")


@dataclass(frozen=True)
class RegionSpec:
    """Options of one recompute region.

    Args:
        use_reentrant: rebuild through a custom ``autograd.Function`` (True) or
            through saved-tensor hooks (False).
        preserve_rng_state: replay the forward's random state in recomputation.
        output_recompute: do not keep the region's outputs either; adjacent
            regions marked this way merge (MindSpore's ``output_recompute``).
        keep_outputs: keep the region's outputs when the region itself saves
            them (``Cell.recompute`` semantics: the cell's output operator's
            result is kept). Ignored when ``output_recompute`` is True.
        policy: per-operator choice of outputs to keep (None: keep none).
        early_stop: stop recomputing once the last needed tensor is rebuilt.
        determinism_check: ``"default"`` compares shape, dtype and device of
            rebuilt tensors with the saved ones; ``"none"`` turns it off.
        debug: record the operators run in forward and recomputation and print
            both traces when the check fails.
        mp_comm_recompute: recompute model-parallel communication inside the region.
        parallel_optimizer_comm_recompute: recompute the all-gather of sharded
            parameters inside the region (True) or keep them gathered from
            forward (False); None (not passed) leaves the sharding's own
            choice alone (FSDP2's ``reshard_after_forward``).
        stages: re-run a selective region in this many stages in backward, each rebuilding
            only the saved tensors backward reads next, so backward holds one stage at a
            time (NOTE [Re-runs in stages]); 1 re-runs it once; ``"each"`` runs none of its
            code again: each saved tensor is rebuilt on its own, when backward reads it, from
            the operator calls that made it (NOTE [Each saved tensor rebuilt on its own]).

    Examples:
        >>> from remat._vocab.spec import RegionSpec
        >>> RegionSpec(output_recompute=True).output_recompute
        True
    """

    use_reentrant: bool = False
    preserve_rng_state: bool = True
    output_recompute: bool = False
    keep_outputs: bool = False
    policy: Policy | None = None
    early_stop: bool = True
    determinism_check: str = "default"
    debug: bool = False
    mp_comm_recompute: bool = True
    parallel_optimizer_comm_recompute: bool | None = None
    stages: int | str = 1

    def __post_init__(self) -> None:
        api = "remat.RegionSpec"
        for f in fields(self):
            if f.type in ("bool", bool):
                check_bool(api, f.name, getattr(self, f.name))
        if self.parallel_optimizer_comm_recompute is not None:
            check_bool(api, "parallel_optimizer_comm_recompute", self.parallel_optimizer_comm_recompute)
        if self.stages != "each" and (type(self.stages) is not int or self.stages < 1):
            raise ValueError(f"{api}: stages must be an int >= 1 (how many re-runs a region's backward "
                             f"splits its recomputation into) or \"each\" (each saved tensor rebuilt on "
                             f"its own), got {self.stages!r}")
        if self.stages != 1 and (self.policy is None or self.output_recompute):
            raise ValueError(
                f"{api}: stages={self.stages} needs a selective policy (policy=remat.save_calls(...) or "
                f"another remat.Policy) and output_recompute=False: a stage re-runs only what its own "
                f"saved tensors need, which only a selective region's re-run can tell"
            )
        if self.determinism_check not in DETERMINISM_CHECKS:
            raise ValueError(
                f"{api}: determinism_check must be one of {DETERMINISM_CHECKS}, "
                f"got {self.determinism_check!r}"
            )
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise TypeError(
                f"{api}: policy must be a remat.Policy such as remat.save_compute_intensive, "
                f"got {type(self.policy).__name__}"
            )
        if self.use_reentrant and self.output_recompute:
            raise ValueError(
                f"{api}: output_recompute=True needs the saved-tensor-hooks implementation; "
                f"pass use_reentrant=False"
            )
        if self.use_reentrant and self.policy is not None:
            raise ValueError(
                f"{api}: a selective policy needs use_reentrant=False, got policy={self.policy!r}"
            )

    def replace(self, **changes: object) -> RegionSpec:
        """Return a copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)
