"""The fork version comes from the top heading of CHANGELOG.md, and only from there."""

from __future__ import annotations

from pathlib import Path

import pytest
from sm120fork.errors import FatalError
from sm120fork.forkversion import ForkVersion, parse_changelog, read_fork_version


def test_top_heading_gives_the_version() -> None:
    text = (
        "# Changelog\n\nIntro.\n\n## 0.5.9+sm120.2 - 2026-12-01\n\n## 0.5.9+sm120.1 - 2026-11-29\n"
    )
    found = parse_changelog(text)
    assert found == ForkVersion("0.5.9", 2, "2026-12-01")
    assert str(found) == "0.5.9+sm120.2"
    assert found.epoch == 1796083200


def test_an_unreleased_top_entry_is_dated_like_the_last_release() -> None:
    text = "# Changelog\n\n## 0.5.9+sm120.2 - unreleased\n\n## 0.5.9+sm120.1 - 2026-11-29\n"
    assert parse_changelog(text) == ForkVersion("0.5.9", 2, "2026-11-29")
    with pytest.raises(FatalError, match="no dated entry follows it"):
        parse_changelog("## 0.5.9+sm120.1 - unreleased\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# Changelog\n", "has no `## ` entry"),
        ("## Unreleased\n\n## 0.5.9+sm120.1 - 2026-11-29\n", "is not like"),
        ("## 0.5.9 - 2026-11-29\n", "is not like"),
        ("## 0.5.9+sm120.0 - 2026-11-29\n", "is not like"),
        ("## 0.5.9+sm120.1\n", "is not like"),
        ("## 0.5.9+sm120.1 - 2026-13-40\n", "is not a date"),
    ],
)
def test_malformed_top_heading(text: str, message: str) -> None:
    with pytest.raises(FatalError, match=message):
        parse_changelog(text)


def test_top_entry_must_be_for_the_locked_upstream(tmp_path: Path) -> None:
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text("## 0.5.9+sm120.4 - 2026-11-29\n")
    assert read_fork_version(changelog, "0.5.9").n == 4
    with pytest.raises(FatalError) as raised:
        read_fork_version(changelog, "0.5.10")
    assert raised.value.message == (
        "CHANGELOG.md's top entry is 0.5.9+sm120.4 but vendor/sglang.lock pins sglang 0.5.10; "
        "add a CHANGELOG entry for 0.5.10+sm120.1 at the top"
    )


def test_missing_changelog(tmp_path: Path) -> None:
    with pytest.raises(FatalError, match=r"## 0\.5\.9\+sm120\.1 - YYYY-MM-DD"):
        read_fork_version(tmp_path / "CHANGELOG.md", "0.5.9")
