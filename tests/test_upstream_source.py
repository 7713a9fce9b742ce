"""Where releases come from, named the one way each reader needs."""

from __future__ import annotations

from sm120fork.upstream.source import PACKAGE_INDEX, UpstreamSource


def test_the_package_index() -> None:
    assert UpstreamSource(None) == PACKAGE_INDEX
    assert (PACKAGE_INDEX.kind, PACKAGE_INDEX.name) == ("pypi", "the package index")
    assert PACKAGE_INDEX.where == "on the package index"


def test_a_git_remote_is_named_without_its_credentials() -> None:
    source = UpstreamSource("https://user:secret@example.invalid/sglang.git")
    assert (source.kind, source.name) == ("git", "git")
    assert source.where == "at https://example.invalid/sglang.git"
