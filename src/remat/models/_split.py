"""A model's blocks split into pipeline stages (`GPTStage`, `LlamaStage`)."""

from __future__ import annotations


def stage_share(api: str, layers: int, index: int, n_stages: int) -> tuple[int, bool, bool]:
    """Stage ``index`` of ``n_stages``: its number of blocks (as even as they go, the first
    stages taking one more where they do not divide), and whether it is the first and the last.

    Examples:
        >>> from remat.models._split import stage_share
        >>> [stage_share("example", 5, i, 2) for i in range(2)]
        [(3, True, False), (2, False, True)]
    """
    if not 0 <= index < n_stages <= layers:
        raise ValueError(f"{api}: stage {index} of {n_stages} for {layers} layers; need "
                         f"0 <= index < n_stages <= layers")
    per, extra = divmod(layers, n_stages)
    return per + (index < extra), index == 0, index == n_stages - 1
