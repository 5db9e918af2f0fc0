"""Numbers for people: sizes and shares in words, bar charts and a tier × shape matrix as
Markdown tables short enough for the Dagster UI to draw them on the asset page (block
characters for bars), and PNGs in Markdown (`data:` image URLs) where a picture cannot be
that short (the reject contact sheet). Pure (no Dagster): `defs.report` turns them into
metadata.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")
# The Dagster UI draws a Markdown entry on the asset page only when it is shorter than this
# (its MetadataEntry: `mdStr.length < 1000`); a longer one hides behind [Show Markdown].
INLINE_MARKDOWN_CHARS = 1000
# Characters of the longest bar, widest first: 12 fit beside the label and the count in
# the asset page's metadata column at 1,280 to 1,920 px.
BAR_WIDTHS = (12, 10, 8, 5)
NBSP = "\u00a0"  # a value ("124 (100.0 %)") stays on one line
BLOCK = "\u2588"  # a full block; the eighths below draw the bar's last part
EIGHTHS = "\u258f\u258e\u258d\u258c\u258b\u258a\u2589"


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


def bar(value: float, top: float, width: int) -> str:
    """A bar of block characters, `width` of them for `top`, in eighths of a character."""
    eighths = round(8 * width * value / top) if top > 0 else 0
    full, part = divmod(max(0, eighths), 8)
    return BLOCK * full + (EIGHTHS[part - 1] if part else "")


def bar_chart_markdown(labels: Sequence[str], values: Sequence[float], title: str,
                       notes: Sequence[str] | None = None) -> str:
    """Horizontal bars as a Markdown table (label, value or note, a bar of block
    characters), first label on top: under INLINE_MARKDOWN_CHARS, so the Dagster UI draws
    it on the asset page. Bars narrow to fit; rows that still do not fit are counted in a
    last row."""
    texts = [text.replace(" ", NBSP) for text in
             (notes if notes is not None else [f"{value:,g}" for value in values])]
    top = max(values, default=0)
    head = [f"**{title}**", "", "| | | |", "| --- | ---: | --- |"]
    for width in BAR_WIDTHS:
        rows = [f"| {label} | {text} | {bar(value, top, width)} |"
                for label, value, text in zip(labels, values, texts, strict=True)]
        chart = "\n".join([*head, *rows])
        if len(chart) < INLINE_MARKDOWN_CHARS:
            return chart
    while rows:  # narrowest bars and still too long: drop rows from the end, say how many
        rows.pop()
        more = f"| … {len(labels) - len(rows)} more | | |"
        chart = "\n".join([*head, *rows, more])
        if len(chart) < INLINE_MARKDOWN_CHARS:
            return chart
    return f"**{title}**"


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
