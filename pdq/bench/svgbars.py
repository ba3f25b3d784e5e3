"""Horizontal bar charts as plain SVG text: the plots of BENCHMARKS.md, with no plotting library.

The output depends only on the input (no dates, no random ids), so a checked-in plot can be
compared with a fresh rendering.
"""

from dataclasses import dataclass
from xml.sax.saxutils import escape

CHAR_W = 6.6  # an average character of 12-px sans-serif, for the labels' column
BAR_W = 380  # the longest bar
TEXT_W = 170  # the value printed after a bar
BAR_H = 16
GAP = 6
TITLE_H = 26
COLORS = {"": "#4c78a8", "alt": "#9d9d9d", "bad": "#e45756", "good": "#54a24b"}


@dataclass(frozen=True)
class Bar:
    """label: left of the bar; value: its length (>= 0); text: printed after it; tone: a key
    of COLORS ("" the default, "alt" a baseline, "bad" / "good" a goal missed / met)."""

    label: str
    value: float
    text: str
    tone: str = ""


@dataclass(frozen=True)
class Panel:
    """One chart: its title and its bars, each scaled against the panel's largest value."""

    title: str
    bars: tuple[Bar, ...]


def _panel(panel: Panel, top: int, label_w: int) -> tuple[list[str], int]:
    out = [f'<text x="8" y="{top + 17}" font-weight="bold">{escape(panel.title)}</text>']
    y = top + TITLE_H
    largest = max((b.value for b in panel.bars), default=0.0) or 1.0
    for b in panel.bars:
        w = max(1.0, BAR_W * max(b.value, 0.0) / largest)
        mid = y + BAR_H - 4
        out += [f'<text x="{label_w - 6}" y="{mid}" text-anchor="end">{escape(b.label)}</text>',
                f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{BAR_H}" fill="{COLORS[b.tone]}"/>',
                f'<text x="{label_w + w + 5:.1f}" y="{mid}">{escape(b.text)}</text>']
        y += BAR_H + GAP
    return out, y + GAP


def svg(panels: list[Panel]) -> str:
    """Panels stacked top to bottom."""
    longest = max((len(b.label) for p in panels for b in p.bars), default=0)
    label_w = int(max(120, CHAR_W * longest + 16))
    width = max(label_w + BAR_W + TEXT_W, int(max((len(p.title) for p in panels), default=0) * 7.5))
    body, y = [], 4
    for panel in panels:
        lines, y = _panel(panel, y, label_w)
        body += lines
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" viewBox="0 0 {width} {y}" '
            'font-family="sans-serif" font-size="12">')
    return "\n".join([head, f'<rect width="{width}" height="{y}" fill="white"/>', *body, "</svg>"]) + "\n"
