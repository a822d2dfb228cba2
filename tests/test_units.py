import pytest

from remat3d.errors import BudgetError, InputShapeError
from remat3d.units import format_bytes, parse_bytes, parse_shape


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("500MB", 500 * 10**6), ("1.5G", int(1.5 * 2**30)),
    ("1024", 1024), (4096, 4096), (" 2 kib ", 2048),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["twelve", "12 parsecs", "-5", "", True])
def test_parse_bytes_rejects(text):
    with pytest.raises(BudgetError, match="byte size"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1536 * 2**10) == "1.5 MiB"
    assert format_bytes(12) == "12 B"


def test_parse_shape():
    assert parse_shape("1x1x64x64x64") == (1, 1, 64, 64, 64)
    assert parse_shape("1,4,32,32,32") == (1, 4, 32, 32, 32)


@pytest.mark.parametrize("text", ["1x1xax64", "", "0x1x8x8x8", "1x-1x8"])
def test_parse_shape_rejects(text):
    with pytest.raises(InputShapeError, match="BxC|batch x channels"):
        parse_shape(text)
