"""Numbers for people: sizes and shares in words, small bar charts as PNG, a tier × shape
matrix as a Markdown table. Pure (no Dagster): `defs.report` turns them into metadata that
the Dagster UI renders (its Markdown accepts `data:` image URLs).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")
# Chart size in pixels (at CHART_DPI): small enough for a metadata entry (~10-20 KB).
CHART_WIDTH_PX = 560
BAR_HEIGHT_PX = 26
CHART_DPI = 80
BAR_COLOUR = "#4f6d8f"


def human_bytes(n: float) -> str:
    """1000-based, one decimal: 23544848 -> "23.5 MB"."""
    value, unit = float(n), BYTE_UNITS[0]
    for unit in BYTE_UNITS:
        if abs(value) < 1000 or unit == BYTE_UNITS[-1]:
            break
        value /= 1000
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def percent(share: float, digits: int = 1) -> str:
    """0.8421 -> "84.2 %"."""
    return f"{share * 100:.{digits}f} %"


def human_duration(seconds: float) -> str:
    """3725 -> "1 h 2 min"; 75 -> "1 min 15 s"; 4.2 -> "4.2 s"."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def bar_chart_png(labels: Sequence[str], values: Sequence[float], title: str,
                  notes: Sequence[str] | None = None) -> bytes:
    """Horizontal bars, first label on top, each bar annotated with its value (or its
    note); a PNG of CHART_WIDTH_PX width."""
    import matplotlib

    matplotlib.use("Agg")  # no display; set before pyplot is imported
    from matplotlib.figure import Figure

    height_px = BAR_HEIGHT_PX * max(1, len(labels)) + 60
    figure = Figure(figsize=(CHART_WIDTH_PX / CHART_DPI, height_px / CHART_DPI), dpi=CHART_DPI)
    axes = figure.subplots()
    positions = list(range(len(labels)))[::-1]
    axes.barh(positions, values, color=BAR_COLOUR, height=0.7)
    axes.set_yticks(positions, labels=list(labels))
    axes.set_title(title, fontsize=11, loc="left")
    top = max(values, default=0) or 1
    axes.set_xlim(0, top * 1.3)
    texts = list(notes) if notes is not None else [f"{value:,g}" for value in values]
    for y, value, text in zip(positions, values, texts, strict=True):
        axes.text(value + top * 0.01, y, text, va="center", fontsize=9)
    axes.spines[["top", "right"]].set_visible(False)
    axes.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def png_markdown(png: bytes, alt: str) -> str:
    """Markdown that shows the PNG inline (a data URL: no file server needed)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def aspect_of(shape: str) -> float:
    width, height = shape.split("x")
    return int(width) / int(height)


def tier_shape_markdown(counts: Mapping[tuple[int, str], int]) -> str:
    """A Markdown table: one row per tier, one column per aspect ratio (widest last), each
    cell the count and the shape ("12 · 608x432"), blank where a tier has no such shape."""
    if not counts:
        return "_no kept images_"
    aspects = sorted({round(aspect_of(shape), 2) for _, shape in counts})
    tiers = sorted({tier for tier, _ in counts})
    cells: dict[tuple[int, float], str] = {}
    for (tier, shape), n in counts.items():
        key = (tier, round(aspect_of(shape), 2))
        cells[key] = (cells[key] + "<br>" if key in cells else "") + f"{n:,} · {shape}"
    header = "| tier | " + " | ".join(f"w/h {a:g}" for a in aspects) + " | total |"
    rule = "| --- " * (len(aspects) + 2) + "|"
    rows = [f"| {tier} | " + " | ".join(cells.get((tier, a), "") for a in aspects)
            + f" | {sum(n for (t, _), n in counts.items() if t == tier):,} |" for tier in tiers]
    return "\n".join([header, rule, *rows])
