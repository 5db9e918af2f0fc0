"""The jpeg_fidelity check's reads on an object-store root."""

import pyarrow as pa

from prx_assets.stages.images.fidelity import fidelity_report
from prx_assets.stages.images.imaging import ImageOptions, process_image
from prx_assets.storage.lance_tables import overwrite_rows
from prx_assets.storage.layout import Storage
from prx_assets.testing.images import jpeg_bytes


def test_fidelity_reads_its_tables_from_a_bucket_with_the_handles_settings(
        s3_server, s3_root, monkeypatch):
    """The environment holds a wrong secret: the report works only on the settings its
    table handles carry (what the check passes from the storage resource)."""
    options = {"aws_secret_access_key": s3_server.secret_key}
    store = Storage(s3_root, options)
    original = jpeg_bytes(640, 480, 3)  # 0.31 MP: the 0.25-0.5 MP band
    stored = process_image(original)
    ids = ["web:a", "web:b"]
    bucketed, raw = store.table("bucketed_images", "web"), store.table("raw_images", "web")
    written = pa.table({"id": ids, "status": ["ok", "ok"], "width": [stored.width] * 2,
                        "height": [stored.height] * 2, "image": [stored.image] * 2})
    overwrite_rows(bucketed, written, written.schema)
    originals = pa.table({"id": ids, "image": [original] * 2})
    overwrite_rows(raw, originals, originals.schema)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    reports = fidelity_report(bucketed, raw, ImageOptions(), per_band=4)
    band = next(r for r in reports if r.band == "0.25-0.5 MP")
    assert band.samples == 2 and min(band.psnr_stored) > 30
    assert bucketed.count_rows() == 2
