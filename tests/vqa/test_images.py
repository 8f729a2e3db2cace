from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from vqa.images import to_rgb


def _palette_image() -> Image.Image:
    image = Image.new("P", (3, 2), 1)
    image.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    return image


@pytest.mark.parametrize(
    ("image", "expected_pixel"),
    [
        (Image.new("1", (5, 3), 1), (255, 255, 255)),
        (Image.new("L", (5, 3), 77), (77, 77, 77)),
        (_palette_image(), (10, 200, 30)),
        (Image.new("LA", (2, 2), (40, 255)), (40, 40, 40)),
        (Image.new("RGBA", (2, 2), (255, 0, 0, 255)), (255, 0, 0)),
        (Image.new("RGBA", (2, 2), (255, 0, 0, 0)), (255, 255, 255)),
        (Image.new("CMYK", (2, 2), (0, 0, 0, 0)), (255, 255, 255)),
        (Image.new("YCbCr", (2, 2), (255, 128, 128)), (255, 255, 255)),
    ],
    ids=["1-bit", "L", "P", "LA", "RGBA-opaque", "RGBA-transparent", "CMYK", "YCbCr"],
)
def test_common_modes_become_rgb(image: Image.Image, expected_pixel: tuple[int, int, int]) -> None:
    converted = to_rgb(image)
    assert converted.mode == "RGB"
    assert converted.size == image.size
    assert converted.getpixel((0, 0)) == expected_pixel


def test_half_transparent_pixel_is_composited_on_white() -> None:
    converted = to_rgb(Image.new("RGBA", (1, 1), (0, 0, 0, 128)))
    assert all(abs(channel - 127) <= 1 for channel in converted.getpixel((0, 0)))


def test_palette_transparency_is_composited_on_white() -> None:
    image = _palette_image()
    image.info["transparency"] = 1
    assert to_rgb(image).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_high_bit_depth_is_stretched_to_the_full_8bit_range(mode: str) -> None:
    # A 12-bit medical ramp: dark as raw 16-bit, full-range after the min-max window.
    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    image = Image.fromarray(np.array([[0, 1000, 4095]], dtype=dtype))
    assert image.mode == mode
    converted = to_rgb(image)
    assert converted.mode == "RGB"
    assert [converted.getpixel((x, 0))[0] for x in range(3)] == [0, 62, 255]


def test_sixteen_bit_png_round_trip() -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.array([[0, 65535]], dtype=np.uint16)).save(buffer, format="PNG")
    converted = to_rgb(Image.open(io.BytesIO(buffer.getvalue())))
    assert converted.getpixel((0, 0)) == (0, 0, 0) and converted.getpixel((1, 0)) == (255, 255, 255)


def test_constant_high_bit_depth_image_is_accepted() -> None:
    assert to_rgb(Image.new("I", (4, 4), 5)).getpixel((0, 0)) == (0, 0, 0)


@pytest.mark.parametrize("size", [(1, 1), (3, 517), (1023, 2)])
def test_odd_sizes_are_kept(size: tuple[int, int]) -> None:
    assert to_rgb(Image.new("RGB", size)).size == size
