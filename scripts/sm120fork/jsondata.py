"""Reading parsed JSON (what `json.loads` returns) into typed values.

Each getter checks the shape it promises: a missing key is a KeyError, a value
of another type a TypeError, so a damaged file is refused by the caller's
`except`, and nothing typed `Any` leaves the reading code.
"""

from __future__ import annotations

from collections.abc import Mapping

JsonObject = Mapping[str, object]


def obj(value: object) -> JsonObject:
    """`value` as a JSON object."""
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, not {type(value).__name__}")
    return value


def array(value: object) -> list[object]:
    """`value` as a JSON array."""
    if not isinstance(value, list):
        raise TypeError(f"expected a JSON array, not {type(value).__name__}")
    return value


def text(data: JsonObject, key: str, default: str | None = None) -> str:
    """`data[key]`, a string (`default` where the key is left out, if given)."""
    if key not in data and default is not None:
        return default
    value = data[key]
    if not isinstance(value, str):
        raise TypeError(f"{key}: expected a string, not {type(value).__name__}")
    return value


def optional_text(data: JsonObject, key: str) -> str | None:
    """`data[key]`, a string or null; a key left out reads as null."""
    value = data.get(key)
    return None if value is None else text(data, key)


def integer(data: JsonObject, key: str, default: int | None = None) -> int:
    """`data[key]` as an int (written as a number or a string of digits)."""
    if key not in data and default is not None:
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{key}: expected an integer, not {type(value).__name__}")
    return int(value)


def number(data: JsonObject, key: str) -> float:
    """`data[key]` as a float (written as a number or a string of one)."""
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{key}: expected a number, not {type(value).__name__}")
    return float(value)


def flag(data: JsonObject, key: str, default: bool = False) -> bool:
    """`data[key]` as a bool (`default` where the key is left out)."""
    return bool(data.get(key, default))


def texts(data: JsonObject, key: str) -> tuple[str, ...]:
    """`data[key]`, an array of strings (empty where the key is left out)."""
    values = array(data.get(key, []))
    for value in values:
        if not isinstance(value, str):
            raise TypeError(f"{key}: expected strings, not {type(value).__name__}")
    return tuple(str(value) for value in values)
