import lance
import pyarrow as pa
import pytest

from prx_assets.stages.images.fidelity import fidelity_report
from prx_assets.stages.images.imaging import ImageOptions, process_image
from prx_assets.storage.filters import all_of, eq_filter, in_filter, sql_string
from prx_assets.storage.refs import TableRef
from prx_assets.testing.images import jpeg_bytes

QUOTED = "web:o'brien's cat.jpg"


@pytest.fixture
def table(tmp_path):
    ids = ["web:a", QUOTED, "web:x' OR '1'='1"]
    return lance.write_dataset(pa.table({"id": ids, "label": ["text", "visual", "nsfw"]}),
                               str(tmp_path / "t.lance"))


def test_a_value_with_a_quote_selects_its_own_row_and_nothing_else(table):
    assert sql_string(QUOTED) == "'web:o''brien''s cat.jpg'"
    assert table.to_table(filter=eq_filter("id", QUOTED)).column("id").to_pylist() == [QUOTED]
    # A value shaped like an injection is a value, not SQL: it matches only itself.
    injected = "web:x' OR '1'='1"
    assert table.count_rows(filter=eq_filter("id", injected)) == 1
    assert table.count_rows(filter=eq_filter("id", "nope' OR '1'='1")) == 0
    got = table.to_table(filter=in_filter("id", [QUOTED, "web:a", "absent"])).column("id")
    assert sorted(got.to_pylist()) == sorted(["web:a", QUOTED])


def test_no_values_select_no_rows_and_empty_conditions_are_left_out(table):
    assert table.count_rows(filter=in_filter("id", [])) == 0
    assert all_of(None, "") is None
    both = all_of(eq_filter("id", QUOTED), None, in_filter("label", ["visual", "text"]))
    assert both == "id = 'web:o''brien''s cat.jpg' AND label IN ('visual', 'text')"
    assert table.count_rows(filter=both) == 1


def test_fidelity_samples_ids_holding_a_quote(tmp_path):
    """The fidelity check reads its sampled rows back by id: an id with a quote (a file
    named o'brien.jpg) must not break the check."""
    original = jpeg_bytes(640, 480, 3)  # 0.31 MP: the 0.25-0.5 MP band
    stored = process_image(original)
    ids = [QUOTED, "web:plain"]
    bucketed = tmp_path / "bucketed.lance"
    raw = tmp_path / "raw.lance"
    lance.write_dataset(pa.table({
        "id": ids, "status": ["ok", "ok"], "width": [stored.width] * 2,
        "height": [stored.height] * 2, "image": [stored.image] * 2}), str(bucketed))
    lance.write_dataset(pa.table({"id": ids, "image": [original] * 2}), str(raw))
    reports = fidelity_report(TableRef.of(bucketed), TableRef.of(raw), ImageOptions(), per_band=4)
    band = next(r for r in reports if r.band == "0.25-0.5 MP")
    assert band.samples == 2 and min(band.psnr_stored) > 30
