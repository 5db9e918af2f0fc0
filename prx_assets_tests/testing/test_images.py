"""Test images are the same bytes whatever ran before them in the process."""

from PIL import Image

from prx_assets.testing.images import jpeg_bytes


def test_a_test_jpeg_does_not_depend_on_what_ran_before():
    """While the grain came from Pillow's `effect_noise` (C's `rand`, one state per
    process), each call gave other bytes: a test that cut a tar at an offset assuming the
    JPEG's size (`test_hostile_inputs`, truncated tar) kept or lost a whole member depending
    on which test files its worker had run before."""
    first = jpeg_bytes(400, 400)
    Image.effect_noise((64, 64), 30)  # moves C's rand, as any earlier test may have
    assert jpeg_bytes(400, 400) == first
