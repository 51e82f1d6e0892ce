"""The markdown report of ``remat bench``: tables per workload, and the README block they fill.

Example:
    >>> from benchmarks.bench_report import BEGIN, END, include_markdown
    >>> BEGIN.startswith("<!-- bench:begin")
    True
"""

from __future__ import annotations

BASELINE = "none"

BEGIN, END = "<!-- bench:begin (written by remat bench) -->", "<!-- bench:end -->"


def include_markdown(path: str, markdown: str) -> bool:
    """Replace the text between the bench markers of ``path`` with ``markdown``.

    Returns:
        Whether ``path`` had the markers (and was rewritten).
    """
    with open(path) as file:
        text = file.read()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as file:
        file.write(f"{head}{BEGIN}\n{markdown.rstrip()}\n{END}{tail}")
    return True


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _with_ratio(nbytes: int | None, ratio: float | None) -> str:
    return _mib(nbytes) if ratio is None else f"{_mib(nbytes)} ({ratio:.2f}x)"


def _x(r: float | None, digits: int = 2) -> str:
    return "n/a" if r is None else f"{r:.{digits}f}"


def render_markdown(result: dict) -> str:
    """Render the results as markdown tables, one per workload (ratios to no recompute)."""
    m = result["method"]
    lines = [
        (f"Threads: {result['torch_threads']} (OMP_NUM_THREADS={result['OMP_NUM_THREADS']}), "
        f"torch {result['torch']}, {result['device']}; {m['warmup']} warm-up steps per "
        f"configuration, {m['trials']} trials x {m['pairs']} pairs, gc off while timing; "
        f"memory: {result['memory_source'] or 'tracker not available'} (peak of one step) and "
        f"remat.memory.saved_bytes (kept for backward). Time: median of the pair ratios "
        f"[quartiles]. vs torch: remat / torch non-reentrant on the same blocks. Compiled "
        f"rows (backend aot_eager): peak from allocator events, memory ratios to 'compiled "
        f"none' (remat.compile without marks), kept = what the compiled graph saves. "
        f"Total {result['seconds']:.0f} s."),
        "",
    ]
    for w in result["workloads"]:
        lines += [f"**{w['name']}**", "",
                  ("| configuration | peak memory | kept for backward | step time | "
                  "vs torch: peak / kept / time |"),
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, r in w["rows"].items():
            vs = r.get("vs_torch")
            versus = "" if not vs else " / ".join(_x(vs[k], 3) for k in ("peak", "kept", "time"))
            time_cell = (f"{r['step_s'] * 1000:.0f} ms (1.00x)" if name == BASELINE else
                         f"{r['time_ratio']:.3f}x [{r['time_q1']:.3f}, {r['time_q3']:.3f}]")
            lines.append(
                f"| {name} | {_with_ratio(r['peak_bytes'], r['peak_ratio'])} | "
                f"{_with_ratio(r['kept_bytes'], r['kept_ratio'])} | {time_cell} | {versus} |"
            )
        lines.append("")
    return "\n".join(lines)
