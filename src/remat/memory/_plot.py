"""``remat.memory.plot_timeline``: live bytes over a step, one line per configuration.

matplotlib is imported only when a plot is drawn (with the ``Agg`` backend, so
no display is needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#55a868",
                "optimizer": "#8172b3"}
#: one colour and one dash pattern per configuration: told apart in colour and in grey
LINE_COLORS = ("#222222", "#c44e52", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
LINE_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (8, 2)))


def _series(item: Any) -> tuple[str, list, int]:
    """Return ``(label, timeline, baseline bytes)`` of a ProfileReport or MemoryTracker."""
    if hasattr(item, "rows"):  # ProfileReport
        return item.label, list(item.timeline), item.baseline_bytes
    return getattr(item, "label", "step"), list(item.timeline), item.baseline_bytes


def _phase_spans(timeline: list) -> list[tuple[float, float, str]]:
    """Runs of equal phase as ``(start, end, phase)`` on a 0..1 progress axis."""
    spans, count = [], max(len(timeline) - 1, 1)
    start = 0
    for i in range(1, len(timeline) + 1):
        if i == len(timeline) or timeline[i][1] != timeline[start][1]:
            spans.append((start / count, min(i, count) / count, timeline[start][1]))
            start = i
    return spans


def plot_timeline(runs: Sequence[Any], path: str, *, title: str = "Memory over one training step",
                  labels: Sequence[str] = ()) -> str:
    """Draw live memory over the step for each run and write a PNG to ``path``.

    Each run is a `ProfileReport` (from ``remat.profile`` or
    ``remat.estimate``) or a `MemoryTracker`. The x axis is
    progress through the step (allocation events, scaled to 0..1 so runs of
    different length line up); the y axis is the footprint (baseline plus live
    allocations) in MiB. A strip under the plot shades each run's phases:
    forward, backward, recompute, optimizer. Each peak is marked.

    Args:
        runs: the runs to draw, e.g. ``[before, after]``.
        path: the PNG file to write.
        title: the plot title.
        labels: names of the runs (default: each report's label).

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install remat[cli]``).

    Examples:
        >>> import torch, remat, tempfile, os
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> report = remat.profile(net, torch.randn(4, 8), repeat=0)
        >>> path = remat.memory.plot_timeline([report], os.path.join(tempfile.mkdtemp(), "t.png"))
        >>> os.path.getsize(path) > 0
        True
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - matplotlib ships with the cli extra
        raise ImportError("remat.memory.plot_timeline: needs matplotlib; pip install 'remat[cli]'") from err
    series = [_series(r) for r in runs]
    if labels:
        series = [(name, tl, base) for name, (_, tl, base) in zip(labels, series)]
    fig, axes = plt.subplots(1 + len(series), 1, figsize=(9, 4.5 + 0.35 * len(series)), sharex=True,
                             gridspec_kw={"height_ratios": [8] + [0.6] * len(series)})
    main = axes[0]
    for i, (name, timeline, base) in enumerate(series):
        color, style = LINE_COLORS[i % len(LINE_COLORS)], LINE_STYLES[i % len(LINE_STYLES)]
        count = max(len(timeline) - 1, 1)
        xs = [j / count for j in range(len(timeline))]
        ys = [(base + b) / 2**20 for b, _ in timeline]
        main.plot(xs, ys, color=color, ls=style, lw=1.4, label=f"{name} (peak {max(ys):,.1f} MiB)")
        top = max(range(len(ys)), key=ys.__getitem__)
        main.plot([xs[top]], [ys[top]], marker="v", color=color, ms=8)
        if len(series) == 1:  # with several lines the legend gives each peak
            main.annotate(f"{ys[top]:,.1f} MiB", (xs[top], ys[top]), textcoords="offset points",
                          xytext=(-40, 8), color=color, fontsize=8)
        strip = axes[1 + i]
        for start, end, phase in _phase_spans(timeline):
            strip.axvspan(start, end, color=PHASE_COLORS.get(phase, "#bbbbbb"), lw=0)
        strip.set_yticks([])
        strip.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    main.set_ylabel("live tensor memory (MiB)")
    main.set_title(title)
    main.grid(alpha=0.3)
    handles, names = main.get_legend_handles_labels()
    shown = [p for p in PHASE_COLORS if any(phase == p for _, tl, _ in series for _, phase in tl)]
    handles += [Patch(color=PHASE_COLORS[p], label=p) for p in shown]  # only phases a strip shows
    # outside the axes, right of them: it covers no curve
    main.legend(handles, names + shown, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                borderaxespad=0)
    axes[-1].set_xlabel("progress through the step (allocation and free events)")
    axes[-1].set_xlim(0, 1)
    fig.set_size_inches(13, fig.get_size_inches()[1])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
