"""Split text into lines the way diff and patch do: on "\\n" only.

`str.splitlines` also breaks on form feeds, "\\x1c".."\\x1e", "\\u2028" and
friends, which do occur in source files; a patch tool must not.
"""

from __future__ import annotations


def split_lines(text: str) -> list[str]:
    """Lines with their "\\n" kept; a last line without one is kept as it is."""
    lines = text.split("\n")
    tail = lines.pop()
    result = [line + "\n" for line in lines]
    if tail:
        result.append(tail)
    return result


def split_rows(text: str) -> list[str]:
    """Lines without their "\\n" (a final newline does not add an empty row)."""
    return [line.removesuffix("\n") for line in split_lines(text)]
