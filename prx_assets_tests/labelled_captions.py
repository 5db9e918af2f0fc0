"""Captions written for the tests (not in the training set), and a captions table maker
in the captions table's schema (CAPTIONS_SCHEMA), for tests that start from captions."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import lance
import pyarrow as pa

from prx_assets.core.captions import CAPTIONS_SCHEMA

TEST_CAPTIONS = {
    "visual": [
        "A photograph of a grey heron standing in shallow water at the edge of a reed bed. "
        "Its long neck is curved into an S shape and its yellow beak points down toward the "
        "water. Ripples spread around its thin legs. The reeds behind it are pale brown and "
        "bend to the right in the wind, and the water reflects an overcast white sky.",
        "Interior of a small bakery seen from the doorway. Wooden shelves along the back wall "
        "hold round loaves of dark rye bread and baguettes standing upright in a wicker basket. "
        "A woman in a flour-dusted apron stands behind a glass counter filled with pastries. "
        "Warm yellow light comes from pendant lamps, and the tiled floor is black and white.",
    ],
    "text": [
        "A screenshot of a spreadsheet titled \"Budget 2024\". The columns are labelled "
        "\"Category\", \"Planned\", \"Actual\" and \"Difference\", with rows for rent, "
        "groceries, transport and utilities. Numbers fill every cell and a total row at the "
        "bottom is highlighted in bold. The toolbar at the top shows menus for File, Edit, "
        "View and Insert, and a formula bar reads \"=SUM(B2:B9)\".",
        "A photographed page of a printed user manual. The heading reads \"Installing the "
        "battery\" followed by numbered steps: \"1. Open the cover on the back of the device\", "
        "\"2. Insert the battery with the contacts facing down\", \"3. Close the cover until it "
        "clicks\". A warning box in the lower half reads \"Do not expose the battery to heat\". "
        "The page is almost entirely small black text.",
    ],
    "nsfw": [
        "An explicit photograph of two nude adults having sexual intercourse on a sofa. The "
        "woman sits astride the man and penetration is visible. Their clothes lie on the floor "
        "beside a coffee table. The room is lit by a single lamp, and a framed print hangs on "
        "the wall behind them. The image is sexually explicit adult content.",
        "A nude adult man reclines on a bed with his erect penis exposed, one hand on his "
        "genitals, facing the camera in a sexual pose. White pillows are stacked behind him "
        "and a grey blanket is pushed to the side. The photo looks like an amateur explicit "
        "picture taken with a phone in a dim bedroom.",
    ],
}



def labelled_test_captions(source: str = "web") -> list[tuple[str, str, str]]:
    """(id, caption, expected label) rows."""
    return [(f"{source}:{label}{i}", caption, label)
            for label, captions in TEST_CAPTIONS.items() for i, caption in enumerate(captions)]


def write_captions(uri: Path, rows: list[tuple[str, str]], version: str,
                   status: str = "ok") -> None:
    """Append (id, caption) rows of one caption version to a captions table."""
    now = datetime.now(timezone.utc)
    table = pa.Table.from_pylist([
        {"id": i, "caption_version": version, "caption": c, "n_words": len(c.split()),
         "model": "test", "backend": "original", "status": status, "error": None,
         "created_at": now} for i, c in rows], schema=CAPTIONS_SCHEMA)
    uri.parent.mkdir(parents=True, exist_ok=True)
    lance.write_dataset(table, str(uri), schema=CAPTIONS_SCHEMA,
                        mode="append" if uri.exists() else "create")
