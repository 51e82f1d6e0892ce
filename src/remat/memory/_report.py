"""The per-module memory report: rows, table, JSON, comparison (layer 4: tools, no torch).

A `ProfileReport` is plain data produced by [`remat.profile`][remat.profile] and
[`remat.estimate`][remat.estimate]. Its ``kept_self`` figures add up: the sum over all
rows plus ``outside_kept`` equals ``total_kept``.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass, field
from typing import Any

TIMELINE_POINTS = 4000


@dataclass
class ModuleRow:
    """One module of a profiled step.

    Args:
        name: qualified name (the model itself is named after its class).
        type: class name.
        depth: 0 for the model, 1 for its children, ...
        calls: forward calls in the step.
        kept_self: bytes this module's own operators allocated that are still
            alive when backward starts (what autograd keeps), children excluded.
        kept: the same with its submodules included.
        input_bytes: bytes of its input tensors (parameters excluded).
        output_bytes: bytes of its output tensors.
        if_recomputed: bytes it would keep if recomputed: inputs, plus the
            output unless ``output_recompute``.
        forward_ms: forward time, children included: the cost of recomputing it.
        param_bytes: bytes of its parameters, submodules included.
        marked: whether it carries a recompute mark.
    """

    name: str
    type: str
    depth: int
    calls: int = 0
    kept_self: int = 0
    kept: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    if_recomputed: int = 0
    forward_ms: float | None = None
    param_bytes: int = 0
    marked: bool = False


@dataclass
class ProfileReport:
    """Memory and time of one training step, per module; see [`remat.profile`][remat.profile].

    Attributes:
        label: the name given (``label=``), printed in the title.
        device: where the step ran (``"cpu"``, ``"cuda"``; an estimate's device).
        estimated: True for [`remat.estimate`][remat.estimate]'s report (fake tensors).
        rows: one [`ModuleRow`][remat.memory.ModuleRow] per module, in call order.
        total_kept: bytes kept for backward at the end of the forward, by every module.
        outside_kept: of those, bytes kept by operators outside every module.
        peak_bytes: the step's peak footprint (parameters, gradients, optimizer state and
            activations).
        peak_increase: the peak above the footprint before the step.
        peak_phase: the phase the peak falls in (``"forward"``, ``"backward"``, ...).
        baseline_bytes: the footprint before the step.
        param_bytes: bytes of the parameters.
        grad_bytes: bytes of the gradients.
        optimizer_bytes: bytes of the optimizer state.
        peak_by_phase: bytes allocated during the step and alive at the peak, per phase that
            allocated them.
        peak_by_module: the same bytes per module.
        step_ms: the median step time, forward and backward (None: not timed).
        seconds: seconds the measurement took.
        timeline: ``(bytes, phase)`` after each allocation and free of the step, in order.
        phase_peaks: the highest footprint reached in each phase.
        rank: under ``torch.distributed``, the rank measured (None: one process).
        world_size: the ranks in the job; every byte figure is the rank's.
        composed: non-empty when the estimate was composed from short models of identical
            blocks (then ``timeline``, ``peak_by_phase`` and ``peak_by_module`` are empty).

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> report = remat.profile(net, torch.randn(4, 8))
        >>> sum(r.kept_self for r in report.rows) + report.outside_kept == report.total_kept
        True
    """

    label: str
    device: str
    estimated: bool
    rows: list = field(default_factory=list)
    total_kept: int = 0
    outside_kept: int = 0
    peak_bytes: int = 0
    peak_increase: int = 0
    peak_phase: str = ""
    baseline_bytes: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    peak_by_phase: dict = field(default_factory=dict)
    peak_by_module: dict = field(default_factory=dict)
    step_ms: float | None = None
    seconds: float = 0.0
    timeline: list = field(default_factory=list)
    #: the highest footprint (bytes) reached in each phase (``"forward"``, ``"backward"``, ...)
    phase_peaks: dict = field(default_factory=dict)
    #: under ``torch.distributed`` (a real group, or [`remat.estimate`][remat.estimate]'s fake one): the
    #: rank measured and the ranks in the job; every byte figure is this rank's (None: one process)
    rank: int | None = None
    world_size: int | None = None
    #: non-empty when [`remat.estimate`][remat.estimate] composed the report from short models of identical
    #: blocks (``compose=True``, NOTE [Composing an estimate] in ``remat/memory/_compose.py``):
    #: then ``timeline``, ``peak_by_phase`` and ``peak_by_module`` are empty
    composed: str = ""

    def row(self, name: str) -> ModuleRow:
        """Return the row of module ``name``; raise ``KeyError`` naming the known ones."""
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"ProfileReport.row: no module {name!r}; known: {[r.name for r in self.rows][:10]}...")

    def table(self, depth: int = 2) -> str:
        """The report as a plain-text table of modules down to ``depth``, with totals."""
        return _render(self, depth, rich=False)

    def print(self, depth: int = 2) -> None:
        """Print the table, with ``rich`` when it is installed."""
        print(_render(self, depth, rich=True), end="")

    def __str__(self) -> str:
        return self.table()

    def to_json(self, path: str | None = None) -> str:
        """Return the report as JSON text, and write it to ``path`` when given."""
        text = json.dumps(dataclasses.asdict(self), indent=1)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        return text

    @classmethod
    def from_json(cls, text: str) -> ProfileReport:
        """Rebuild a report from `to_json` output."""
        data = json.loads(text)
        data["rows"] = [ModuleRow(**r) for r in data["rows"]]
        data["timeline"] = [tuple(p) for p in data["timeline"]]
        return cls(**data)

    def compare(self, other: ProfileReport, depth: int = 2) -> str:
        """A table of this report (before) against ``other`` (after): kept bytes and peak."""
        after = {r.name: r for r in other.rows}
        lines = [f"{'module':<34} {'kept ' + self.label:>16} {'kept ' + other.label:>16} {'change':>12}"]
        for row in self.rows:
            if row.depth <= depth and row.name in after:
                new = after[row.name].kept
                lines.append(f"{_indent(row):<34} {format_bytes(row.kept):>16} {format_bytes(new):>16} {_delta(new - row.kept):>12}")
        lines.append(f"{'total kept':<34} {format_bytes(self.total_kept):>16} {format_bytes(other.total_kept):>16} "
                     f"{_delta(other.total_kept - self.total_kept):>12}")
        lines.append(f"{'step peak':<34} {format_bytes(self.peak_bytes):>16} {format_bytes(other.peak_bytes):>16} "
                     f"{_delta(other.peak_bytes - self.peak_bytes):>12}")
        if self.step_ms and other.step_ms:
            lines.append(f"{'step time':<34} {self.step_ms:>13.1f} ms {other.step_ms:>13.1f} ms "
                         f"{100 * (other.step_ms / self.step_ms - 1):>+11.0f}%")
        return "\n".join(lines) + "\n"


def downsample(timeline: list, points: int = TIMELINE_POINTS) -> list:
    """Keep at most ``points`` samples of ``(bytes, phase)``: each bucket's largest one."""
    if len(timeline) <= points:
        return list(timeline)
    size = len(timeline) / points
    out = []
    for i in range(points):
        bucket = timeline[int(i * size): max(int((i + 1) * size), int(i * size) + 1)]
        out.append(max(bucket, key=lambda p: p[0]))
    return out


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: ``1.50 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes:,.0f} B"


def _delta(nbytes: int) -> str:
    return ("+" if nbytes > 0 else "") + format_bytes(nbytes)


def _indent(row: ModuleRow) -> str:
    return "  " * row.depth + row.name


COLUMNS = ("module", "type", "kept", "if recomputed", "forward ms", "params", "mark")


def _cells(row: ModuleRow) -> list[str]:
    ms = "-" if row.forward_ms is None else f"{row.forward_ms:.2f}"
    return [_indent(row), row.type, format_bytes(row.kept), format_bytes(row.if_recomputed), ms,
            format_bytes(row.param_bytes), "recompute" if row.marked else ""]


def _footer(report: ProfileReport) -> list[str]:
    kind = "estimated on fake tensors" if report.estimated else "measured"
    rank = f", rank {report.rank} of {report.world_size}" if report.world_size is not None else ""
    lines = [
        f"{report.label}: {kind}, {report.device}" + (rank if rank[2:] not in report.device else ""),
        (f"total kept for backward {format_bytes(report.total_kept)} "
        f"(modules {format_bytes(report.total_kept - report.outside_kept)} + outside modules "
        f"{format_bytes(report.outside_kept)})"),
        (f"step peak {format_bytes(report.peak_bytes)} in {report.peak_phase}: params {format_bytes(report.param_bytes)}, "
        f"optimizer state {format_bytes(report.optimizer_bytes)}, other baseline "
        f"{format_bytes(report.baseline_bytes - report.param_bytes - report.optimizer_bytes)}, "
        f"allocated in the step {format_bytes(report.peak_increase)}"),
    ]
    if report.composed:
        lines.append(f"composed: {report.composed} (no timeline, no bytes by module at the peak)")
    if report.peak_by_phase:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in report.peak_by_phase.items())
        lines.append(f"alive at the peak by phase: {parts}")
    if report.step_ms is not None:
        lines.append(f"step time {report.step_ms:.1f} ms (forward + backward)")
    return lines


def _render(report: ProfileReport, depth: int, *, rich: bool) -> str:
    rows = [r for r in report.rows if r.depth <= depth]
    if rich:
        try:
            return _render_rich(report, rows)
        except ImportError:
            pass
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    out = []
    for n, line in enumerate(table):
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if n == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out + [""] + _footer(report)) + "\n"


def _render_rich(report: ProfileReport, rows: list) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"remat profile: {report.label}")
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="left" if i < 2 else "right")
    for row in rows:
        table.add_row(*_cells(row))
    buffer = io.StringIO()
    console = Console(file=buffer, width=140, force_terminal=False)
    console.print(table)
    console.print("\n".join(_footer(report)))
    return buffer.getvalue()


def as_dict(report: ProfileReport) -> dict[str, Any]:
    """The report as plain data (what `ProfileReport.to_json` writes)."""
    return dataclasses.asdict(report)
