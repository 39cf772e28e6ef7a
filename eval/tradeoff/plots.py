"""The report's pictures (matplotlib, no pyplot state): one metric against another, the Pareto frontier
drawn through its points, every point labelled where its label overlaps no other label or point."""
from __future__ import annotations

import io
from dataclasses import dataclass

LOG_SPAN = 10.0  # an axis whose values span this factor or more is drawn in log scale
# label offsets in points (dx, dy, horizontal alignment), tried in order at growing distances
OFFSETS = [(6, 5, "left"), (6, -11, "left"), (-6, 5, "right"), (-6, -11, "right"), (0, 9, "center"),
           (0, -15, "center"), (9, -3, "left"), (-9, -3, "right")]
SCALES = (1, 2, 3.5, 5, 7)  # the offsets' distances, nearest first
MARKER_PX = 5  # half-size of the box kept free around every point


@dataclass(frozen=True)
class Series:
    """What one plot shows: labelled points, which of them form the frontier, and the axes' names."""

    points: list[tuple[str, float, float]]  # (label, x, y)
    front: list[str]
    xlabel: str
    ylabel: str
    title: str
    logy: bool | None = None  # None: decide from the span


def _log(values: list[float]) -> bool:
    pos = [v for v in values if v > 0]
    return len(pos) == len(values) and len(pos) > 1 and max(pos) / min(pos) >= LOG_SPAN


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(ax, points: list[tuple[str, float, float]], fontsize: float = 8) -> list:
    """Annotate each point at the first offset whose text box is inside the axes and clear of every other
    label and point; with none clear, the offset with the least overlap. Returns the annotations."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    marks = [ax.transData.transform((x, y)) for _, x, y in points]
    taken = [Bbox.from_extents(px - MARKER_PX, py - MARKER_PX, px + MARKER_PX, py + MARKER_PX) for px, py in marks]
    if ax.get_legend() is not None:
        taken.append(ax.get_legend().get_window_extent(renderer))
    placed = []
    for label, x, y in points:
        best = None
        for scale in SCALES:
            for dx, dy, ha in OFFSETS:
                ann = ax.annotate(label, (x, y), xytext=(dx * scale, dy * scale), textcoords="offset points",
                                  ha=ha, fontsize=fontsize,
                                  arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5"} if scale > 1 else None)
                box = ann.get_window_extent(renderer).expanded(1.05, 1.1)
                inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
                cost = sum(_overlap(box, t) for t in taken) + (0 if inside else 1e6)
                if best is None or cost < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (cost, ann, box)
                else:
                    ann.remove()
                if cost == 0:
                    break
            if best[0] == 0:
                break
        taken.append(best[2])
        placed.append(best[1])
    return placed


def scatter_png(s: Series, dpi: int = 110) -> bytes:
    """One scatter plot with its frontier as a dashed line, as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs, ys = [p[1] for p in s.points], [p[2] for p in s.points]
    on = {label for label in s.front}
    ax.scatter([x for (lb, x, _) in s.points if lb not in on], [y for (lb, _, y) in s.points if lb not in on],
               s=28, color="0.55", zorder=3, label="dominated")
    front = sorted((p for p in s.points if p[0] in on), key=lambda p: p[1])
    ax.plot([p[1] for p in front], [p[2] for p in front], "--o", color="tab:blue", ms=6, lw=1.2, zorder=4,
            label="Pareto frontier")
    if _log(xs):
        ax.set_xscale("log")
    if s.logy if s.logy is not None else _log(ys):
        ax.set_yscale("log")
    ax.set_xlabel(s.xlabel)
    ax.set_ylabel(s.ylabel)
    ax.set_title(s.title, fontsize=10)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.margins(0.18, 0.15)
    ax.legend(fontsize=7, loc="best")
    fig.canvas.draw()  # fixes the layout and limits before labels are measured
    place_labels(ax, s.points)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
