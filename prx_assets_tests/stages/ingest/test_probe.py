import struct
import zlib

from PIL import Image

from prx_assets.stages.ingest import probe
from prx_assets.testing.images import image_bytes, jpeg_bytes


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims the given size (a decompression-bomb shape)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)) + b"\x00\x00\x00\x00IEND\xaeB`\x82")


def test_reads_size_and_format_from_headers():
    assert probe.probe_image(jpeg_bytes(640, 480)) == probe.ProbeResult("ok", "JPEG", 640, 480)
    png = image_bytes(Image.new("RGBA", (31, 17)), "PNG")
    assert probe.probe_image(png) == probe.ProbeResult("ok", "PNG", 31, 17)
    webp = image_bytes(Image.new("RGB", (64, 32)), "WEBP")
    assert probe.probe_image(webp) == probe.ProbeResult("ok", "WEBP", 64, 32)


def test_bad_bytes_become_reasons():
    assert probe.probe_image(b"").status == "empty_file"
    assert probe.probe_image(None).status == "empty_file"
    assert probe.probe_image(b"hello world" * 50).status == "not_an_image"
    gif = image_bytes(Image.new("RGB", (10, 10)), "GIF")
    assert probe.probe_image(gif).status == "unsupported_format"
    bmp = image_bytes(Image.new("RGB", (10, 10)), "BMP")
    assert probe.probe_image(bmp).status == "unsupported_format"


def test_truncated_files_are_caught_without_decoding():
    good = jpeg_bytes(800, 600)
    cut = probe.probe_image(good[: len(good) // 2])
    assert cut.status == "truncated" and cut.width == 800
    png = image_bytes(Image.new("RGB", (100, 100)), "PNG")
    assert probe.probe_image(png[:-20]).status == "truncated"
    webp = image_bytes(Image.new("RGB", (100, 100), "green"), "WEBP")
    assert probe.probe_image(webp[:-10]).status == "truncated"


def test_decompression_bombs_are_refused_by_header():
    bomb = png_header_only(100_000, 100_000)
    result = probe.probe_image(bomb)
    assert result.status == "too_many_pixels"
    assert (result.width, result.height) == (100_000, 100_000)
    assert probe.probe_image(jpeg_bytes(200, 200), max_pixels=100).status == "too_many_pixels"


def test_zero_area_is_a_reason():
    assert probe.probe_image(png_header_only(0, 10)).status in ("zero_area", "not_an_image")
