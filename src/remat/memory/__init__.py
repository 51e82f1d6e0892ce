"""``remat.memory``: measure what autograd keeps and what a step allocates.

Examples:
    >>> import torch, remat
    >>> fc = torch.nn.Linear(64, 64)
    >>> x = torch.randn(32, 64)
    >>> remat.memory.saved_bytes(lambda: torch.relu(fc(x)).sum()) > 0
    True
    >>> with remat.memory.track(fc, baseline=[x]) as tracker:
    ...     torch.relu(fc(x)).sum().backward()
    >>> tracker.peak_bytes >= tracker.baseline_bytes
    True
"""

from remat.memory._allocator import allocator_peak
from remat.memory._plot import plot_timeline
from remat.memory._report import ModuleRow, ProfileReport, format_bytes
from remat.memory._saved import saved_bytes
from remat.memory._tracker import MemoryTracker, PeakReport, track

__all__ = [
    "MemoryTracker",
    "ModuleRow",
    "PeakReport",
    "ProfileReport",
    "allocator_peak",
    "format_bytes",
    "plot_timeline",
    "saved_bytes",
    "track",
]
