"""What every figure shares: one colour per method everywhere, small multiples, and a check that
no panel silently drew nothing.

Colours come from the registries' order, so a method keeps its colour in every figure of the
notebook and of results/*.md (`ATTACK_COLORS`, `DEFENSE_COLORS`, `POLICY_COLORS`,
`PARADIGM_COLORS`). A figure with more series than a reader can tell apart in one panel is drawn
as small multiples (`small_multiples`): one panel per method, shared axes, the reference drawn in
every panel.
"""

import math
from collections.abc import Iterable

import matplotlib.pyplot as plt
import matplotlib.text as mtext
import numpy as np

from attacks.base import ATTACKS
from privacy import DEFENSES
from pruning import POLICIES
from vlm.paradigms import PARADIGMS

# matplotlib's tab10 then the darker half of tab20b: twenty colours a reader can tell apart side by side.
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d",
           "#31a354", "#756bb1", "#636363")
# Lines drawn with this gid (baselines, chance, the diagonal) are references, not data (check_figure).
REFERENCE = "reference"


def colors(names: Iterable[str]) -> dict[str, str]:
    """A colour per name, in order (past twenty the cycle repeats)."""
    return {name: PALETTE[index % len(PALETTE)] for index, name in enumerate(names)}


ATTACK_COLORS = colors(ATTACKS.names())
DEFENSE_COLORS = colors(["none", *DEFENSES.names()])
POLICY_COLORS = colors(POLICIES.names())
# The training paradigms (the task-vector runs have figures of their own).
PARADIGM_COLORS = colors(paradigm.name for paradigm in PARADIGMS if paradigm.trains)


def small_multiples(count: int, columns: int = 4, panel: tuple[float, float] = (3.2, 2.6), sharey: bool = True):
    """A figure of `count` panels in rows of `columns` with shared axes (unused panels hidden);
    returns (figure, the `count` axes in reading order)."""
    if count < 1:
        raise ValueError(f"small_multiples needs at least one panel, got count={count}")
    columns = min(columns, count)
    rows = math.ceil(count / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(panel[0] * columns, panel[1] * rows), sharex=True,
                                sharey=sharey, squeeze=False, constrained_layout=True)
    axes = list(grid.flat)
    for unused in axes[count:]:
        unused.set_visible(False)
    return figure, axes[:count]


def check_figure(figure) -> None:
    """Raise if a visible panel of a matplotlib figure shows no data (a figure that silently drew
    nothing would otherwise look like a result). Lines drawn with gid=REFERENCE (baselines,
    chance, the diagonal) do not count as data."""
    for axes in figure.axes:
        if not axes.get_visible():
            continue
        drawn = [*(line for line in axes.lines if line.get_gid() != REFERENCE), *axes.collections, *axes.images,
                 *(patch for patch in axes.patches if np.isfinite(getattr(patch, "get_height", lambda: np.nan)()))]
        if not drawn:
            raise ValueError(f"the panel {axes.get_title() or axes.get_ylabel()!r} shows no data")


def grid(rows: list, columns: list, present: Iterable, panel: tuple[float, float] = (3.2, 2.6), sharey: bool = True,
         row_names: dict | None = None, xlabel: str | None = None):
    """Small multiples in a rows x columns grid (`small_multiples`) where only the (row, column)
    pairs in `present` are drawn: the others are hidden, and a panel whose lower neighbour is hidden
    shows its x tick labels itself. `row_names` (row: text) labels each row at its leftmost panel,
    `xlabel` the panels that show x tick labels. Returns (figure, {(row, column): axes})."""
    present = set(present)
    figure, axes = small_multiples(len(rows) * len(columns), columns=len(columns), panel=panel, sharey=sharey)
    width = min(len(columns), len(axes))
    panels = {}
    for index, ax in enumerate(axes):
        key = (rows[index // width], columns[index % width])
        if key in present:
            panels[key] = ax
        else:
            ax.set_visible(False)
    for index, ax in enumerate(axes):
        below = index + width
        if ax.get_visible() and (below >= len(axes) or not axes[below].get_visible()):
            ax.xaxis.set_tick_params(labelbottom=True)
            if xlabel:
                ax.set_xlabel(xlabel, fontsize=8)
    for number, row in enumerate(rows):
        shown = [ax for ax in axes[number * width:(number + 1) * width] if ax.get_visible()]
        if row_names and shown:
            shown[0].set_ylabel(row_names[row], fontsize=9, fontweight="bold")
    return figure, panels


def label_points(figure, labels: Iterable[tuple], fontsize: float = 7) -> None:
    """Write each (axes, x, y, text) of `labels` beside its point in data coordinates where it
    overlaps no other label, no marker and no data line, stays inside its panel and is nearer its own
    point than any other marker; a text with no such place next to its point goes further out with a leader
    line (the least crowded place if none is free). Call it last, once the figure and its legend are
    drawn: it lays the figure out to measure."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    boxes: dict = {}
    centres: dict = {}
    lines: dict = {}
    written: dict = {}

    def markers(ax) -> list:
        found = []
        for line in ax.lines:
            if line.get_marker() in (None, "None", "", " ") or not line.get_visible():
                continue
            size = line.get_markersize() * figure.dpi / 72 / 2 + 1
            found += [(x, y, size) for x, y in line.get_transform().transform(line.get_xydata())
                      if np.isfinite(x) and np.isfinite(y)]
        return found

    def strokes(ax) -> np.ndarray:
        """Points every few pixels along the data lines (not the references'), so labels keep off them."""
        found = [np.empty((0, 2))]
        for line in ax.lines:
            if line.get_gid() == REFERENCE or line.get_linestyle() in ("None", "", " ") or not line.get_visible():
                continue
            xy = line.get_transform().transform(line.get_xydata())
            xy = xy[np.isfinite(xy).all(axis=1)]
            for start, end in zip(xy[:-1], xy[1:]):
                steps = max(2, int(np.hypot(*(end - start)) / 3))
                found.append(start + np.linspace(0, 1, steps)[:, None] * (end - start))
        return np.concatenate(found)

    def overlap(box, others) -> float:
        return sum(max(0.0, min(box[2], o[2]) - max(box[0], o[0])) * max(0.0, min(box[3], o[3]) - max(box[1], o[1]))
                   for o in others)

    def distance(box, x, y) -> float:
        return math.hypot(max(box[0] - x, 0, x - box[2]), max(box[1] - y, 0, y - box[3]))

    # (dx, dy) in points and the alignment that puts the text on that side of its point: first right
    # beside it, then further out with a leader line, nearer places first.
    beside = [(4, 3, "left", "bottom"), (-4, 3, "right", "bottom"), (4, -3, "left", "top"),
              (-4, -3, "right", "top"), (0, 6, "center", "bottom"), (0, -6, "center", "top"),
              (6, 0, "left", "center"), (-6, 0, "right", "center")]
    further = sorted(((dx, dy, "left" if dx > 0 else "right", "center") for dx in (-40, -24, -12, 12, 24, 40)
                      for dy in range(-36, 37, 9)), key=lambda side: math.hypot(side[0], side[1]))
    for ax, x, y, text in labels:
        if ax not in boxes:
            centres[ax] = markers(ax)
            boxes[ax] = [(cx - r, cy - r, cx + r, cy + r) for cx, cy, r in centres[ax]]
            written[ax] = []
            lines[ax] = strokes(ax)
        frame = ax.get_window_extent(renderer)
        own = ax.transData.transform((x, y))
        others = [(cx, cy) for cx, cy, _ in centres[ax] if math.hypot(cx - own[0], cy - own[1]) > 1]
        best = None
        for index, (dx, dy, ha, va) in enumerate(beside + further):
            leader = index >= len(beside)
            label = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                                fontsize=fontsize, annotation_clip=False,
                                arrowprops=dict(arrowstyle="-", lw=0.5, color="0.45", shrinkA=0, shrinkB=2)
                                if leader else None)
            label.set_in_layout(False)
            label.update_positions(renderer)
            extent = mtext.Text.get_window_extent(label, renderer)  # the text alone, not its leader line
            box = (extent.x0 - 2, extent.y0 - 2, extent.x1 + 2, extent.y1 + 2)
            outside = (box[2] - box[0]) * (box[3] - box[1]) - overlap(box, [tuple(frame.extents)])
            # Beside its point (no leader line) a label must be nearer its own point than any other.
            closer = 0 if leader else sum(distance(box, cx, cy) < distance(box, *own) for cx, cy in others)
            crossed = ((lines[ax][:, 0] > box[0]) & (lines[ax][:, 0] < box[2]) & (lines[ax][:, 1] > box[1])
                       & (lines[ax][:, 1] < box[3])).sum()
            cost = (100 * overlap(box, written[ax]) + 5 * overlap(box, boxes[ax]) + 10 * outside + 400 * closer
                    + 20 * crossed + (30 + 2 * math.hypot(dx, dy) if leader else 0))
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, label, box)
            else:
                label.remove()
            if cost == 0 or (leader and best[0] <= 30 + 2 * math.hypot(dx, dy)):
                break
        written[ax].append(best[2])


def reference_point(ax, x: float, y: float, paired: bool = True) -> None:
    """The reference run (the undefended one) in a panel: a star with a dotted cross through it, drawn
    with gid=REFERENCE under the data. `paired=False` draws it hollow and grey: a reference from
    another start than the panel's points, shown for orientation but not paired with them."""
    color = "k" if paired else "0.5"
    ax.plot(x, y, "*", color=color, mfc=color if paired else "white", ms=13, gid=REFERENCE, zorder=1.9)
    ax.axhline(y, color=color, lw=0.6, ls=":", gid=REFERENCE)
    ax.axvline(x, color=color, lw=0.6, ls=":", gid=REFERENCE)
