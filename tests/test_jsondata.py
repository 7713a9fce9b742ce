"""Typed reading of parsed JSON: the shape promised, or KeyError / TypeError."""

from __future__ import annotations

import pytest
from sm120fork import jsondata

DATA: jsondata.JsonObject = {
    "name": "a.patch",
    "none": None,
    "line": 12,
    "digits": "7",
    "yes": True,
    "flag": False,
    "list": ["x", "y"],
    "mixed": ["x", 1],
    "object": {"k": 1},
}


def test_values_of_the_promised_type() -> None:
    assert jsondata.text(DATA, "name") == "a.patch"
    assert jsondata.text(DATA, "absent", "") == ""
    assert jsondata.optional_text(DATA, "none") is None
    assert jsondata.optional_text(DATA, "absent") is None
    assert jsondata.integer(DATA, "line") == 12
    assert jsondata.integer(DATA, "digits") == 7
    assert jsondata.integer(DATA, "absent", 0) == 0
    assert jsondata.number(DATA, "line") == 12.0
    assert jsondata.number(DATA, "digits") == 7.0
    assert jsondata.flag(DATA, "yes") is True
    assert jsondata.flag(DATA, "absent") is False
    assert jsondata.texts(DATA, "list") == ("x", "y")
    assert jsondata.texts(DATA, "absent") == ()
    assert jsondata.obj(DATA["object"]) == {"k": 1}
    assert jsondata.array(DATA["list"]) == ["x", "y"]


@pytest.mark.parametrize(
    ("read", "error"),
    [
        (lambda: jsondata.text(DATA, "absent"), KeyError),
        (lambda: jsondata.text(DATA, "line"), TypeError),
        (lambda: jsondata.optional_text(DATA, "line"), TypeError),
        (lambda: jsondata.integer(DATA, "yes"), TypeError),
        (lambda: jsondata.integer(DATA, "list"), TypeError),
        (lambda: jsondata.integer(DATA, "name"), ValueError),
        (lambda: jsondata.number(DATA, "yes"), TypeError),
        (lambda: jsondata.texts(DATA, "mixed"), TypeError),
        (lambda: jsondata.obj(DATA["list"]), TypeError),
        (lambda: jsondata.array(DATA["object"]), TypeError),
    ],
)
def test_another_shape_is_refused(read: object, error: type[Exception]) -> None:
    assert callable(read)
    with pytest.raises(error):
        read()
