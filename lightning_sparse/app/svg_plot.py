"""`line_plot_svg`: overlaid line series, optionally with shaded bands, as a standalone SVG file,
with no plotting dependency.

`lightning-sparse compare` draws one figure (validation loss per method: the mean over seeds and
a band for its 95% interval); a hundred lines of SVG
keep matplotlib and its compiled dependencies out of the install, and the output is plain text
that opens in any browser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from html import escape

__all__ = ["line_plot_svg"]

# Colour-blind-safe palette (Okabe & Ito).
_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
_W, _H = 720, 440
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 170, 40, 50


def line_plot_svg(
    series: Mapping[str, Sequence[Sequence[float]]],
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    bands: Mapping[str, Sequence[Sequence[float]]] | None = None,
) -> str:
    """An SVG document with one polyline per series, a shaded band around it where given, and a
    legend.

    Args:
        series: ``{label: [(x, y), ...]}``; empty series are listed in the legend only.
        bands: ``{label: [(x, low, high), ...]}`` for labels of ``series``: a polygon in the
            series' colour (20% opaque) from ``low`` to ``high``, drawn under the lines.

    Returns:
        The SVG text.

    Raises:
        ValueError: no series has a point; a band for a label that is not a series.
    """
    bands = dict(bands or {})
    unknown = sorted(set(bands) - set(series))
    if unknown:
        raise ValueError(f"line_plot_svg: bands {unknown} have no series; bands name series")
    points = [(float(x), float(y)) for pts in series.values() for x, y in pts]
    if not points:
        raise ValueError("line_plot_svg needs at least one (x, y) point in some series")
    points += [(float(x), float(v)) for pts in bands.values() for x, *ys in pts for v in ys]
    x_lo, x_hi = _span(p[0] for p in points)
    y_lo, y_hi = _span(p[1] for p in points)
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return _TOP + (y_hi - y) / (y_hi - y_lo) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        _text(_W / 2, 22, title, anchor="middle", size=15),
    ]
    for tick in _ticks(y_lo, y_hi):
        out.append(_line(_LEFT, _LEFT + plot_w, sy(tick), sy(tick), "#ddd"))
        out.append(_text(_LEFT - 6, sy(tick) + 4, f"{tick:g}", anchor="end"))
    for tick in _ticks(x_lo, x_hi):
        out.append(_line(sx(tick), sx(tick), _TOP, _TOP + plot_h, "#eee"))
        out.append(_text(sx(tick), _TOP + plot_h + 18, f"{tick:g}", anchor="middle"))
    out += [
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" '
        'fill="none" stroke="#333"/>',
        _text(_LEFT + plot_w / 2, _H - 12, xlabel, anchor="middle"),
        f'<text transform="translate(18 {_TOP + plot_h / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">{escape(ylabel)}</text>',
    ]
    colours = {label: _COLOURS[i % len(_COLOURS)] for i, label in enumerate(series)}
    for label, band in bands.items():  # under every line
        if band:
            edge = [(x, lo) for x, lo, _ in band] + [(x, hi) for x, _, hi in reversed(band)]
            coords = " ".join(f"{sx(float(x)):.1f},{sy(float(y)):.1f}" for x, y in edge)
            out.append(
                f'<polygon points="{coords}" fill="{colours[label]}" fill-opacity="0.2" '
                'stroke="none"/>'
            )
    for i, (label, pts) in enumerate(series.items()):
        colour = colours[label]
        coords = " ".join(f"{sx(float(x)):.1f},{sy(float(y)):.1f}" for x, y in pts)
        if coords:
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
        legend_x, legend_y = _LEFT + plot_w + 14, _TOP + 14 + 20 * i
        out.append(_line(legend_x, legend_x + 22, legend_y, legend_y, colour, width=3))
        out.append(_text(legend_x + 28, legend_y + 4, label))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _line(x1: float, x2: float, y1: float, y2: float, colour: str, width: float = 1) -> str:
    return (
        f'<line x1="{x1:.1f}" x2="{x2:.1f}" y1="{y1:.1f}" y2="{y2:.1f}" '
        f'stroke="{colour}" stroke-width="{width}"/>'
    )


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 12) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}">'
        f"{escape(text)}</text>"
    )


def _span(values: Iterable[float]) -> tuple[float, float]:
    vals = list(values)
    lo, hi = min(vals), max(vals)
    if hi == lo:
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) inside [lo, hi]."""
    raw = (hi - lo) / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    count = int(math.floor((hi - first) / step + 1e-9)) + 1
    return [round(first + i * step, 12) for i in range(count)]
