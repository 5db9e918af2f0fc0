"""The jpeg_fidelity check: its PSNR arithmetic, its cycles, its reads on an object-store root."""

import io

import numpy as np
import pyarrow as pa
from PIL import Image

from prx_assets.stages.images.fidelity import cycle_psnr, fidelity_report, psnr
from prx_assets.stages.images.imaging import ImageOptions, encode_jpeg, process_image
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


def _float64_psnr(reference: np.ndarray, other: np.ndarray) -> float:
    """The definition, on float64 copies (what `psnr` computed before it summed integers)."""
    mse = np.mean((reference.astype(np.float64) - other.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def test_psnr_of_8_bit_images_is_the_float64_definitions_to_the_last_bit():
    """Summed in integers, the squared errors give float64's mean exactly: on noise, on the
    largest error an 8-bit pixel can have (255, which overflows a 16-bit square), and on
    equal images (inf)."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (301, 417, 3), dtype=np.uint8)
    near = np.clip(a.astype(np.int16) + rng.integers(-3, 4, a.shape), 0, 255).astype(np.uint8)
    black, white = np.zeros_like(a), np.full_like(a, 255)
    for x, y in ((a, near), (a, 255 - a), (black, white), (white, black)):
        assert psnr(x, y) == _float64_psnr(x, y)
    assert psnr(black, white) == 0.0 and psnr(a, a.copy()) == float("inf")


def test_cycle_psnr_gives_the_array_per_cycle_pipelines_numbers():
    """Keeping a PIL image between cycles changes nothing the check reports: the same
    PSNRs after 1 and 10 cycles as decoding each cycle to an array and back."""
    reference = np.asarray(Image.open(io.BytesIO(jpeg_bytes(640, 480, 7))).convert("RGB"))
    current, expected = reference, {}
    for n in range(1, 11):
        data = encode_jpeg(Image.fromarray(current), 92, "4:4:4")
        current = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        if n in (1, 10):
            expected[n] = _float64_psnr(reference, current)
    assert cycle_psnr(reference, 92, "4:4:4") == expected
    assert 40 < expected[10] <= expected[1] < 99
