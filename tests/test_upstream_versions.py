"""Version specs: X.Y.Z, vX.Y.Z, vX.Y.x, latest; unknown ones name the nearest releases."""

from __future__ import annotations

import pytest
from sm120fork.errors import FatalError
from sm120fork.upstream.index import file_version
from sm120fork.upstream.pypi import fallback_wheel, target_options
from sm120fork.upstream.versions import nearest_releases, resolve_version

AVAILABLE = [
    "0.5.23", "0.5.11", "0.5.10.post1", "0.5.10", "0.5.10rc0", "0.5.9",
    "0.5.8.post1", "0.4.10.post2", "0.4.10", "0.6.0.dev1", "junk",
]  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0.5.9", "0.5.9"),
        ("v0.5.9", "0.5.9"),
        (" V0.5.10.post1 ", "0.5.10.post1"),
        ("0.5.10-post1", "0.5.10.post1"),  # the same version, as the index spells it
        ("v0.5.x", "0.5.23"),
        ("0.4.x", "0.4.10.post2"),
        ("v0.5.10.x", "0.5.10.post1"),
        ("latest", "0.5.23"),
        ("LATEST", "0.5.23"),
    ],
)
def test_specs_resolve_to_final_or_post_releases(spec: str, expected: str) -> None:
    assert resolve_version(spec, AVAILABLE) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0.5.12", "sglang 0.5.12 is not a release on the package index; "
                   "nearest releases: 0.5.11, 0.5.10.post1, 0.5.23"),
        ("v0.5.24", "nearest releases: 0.5.23, 0.5.11$"),
        ("0.1.0", "nearest releases: 0.4.10, 0.4.10.post2$"),
        ("0.5.10rc0", "not a final release"),
        ("0.6.0.dev1", "not a final release"),
        ("0.6.x", "no sglang release matches 0.6.x on the package index; newest is 0.5.23"),
        ("banana", "is not a version; use X.Y.Z"),
        ("v.x", "no sglang release matches"),
    ],
)  # fmt: skip
def test_bad_specs_say_what_exists(spec: str, message: str) -> None:
    with pytest.raises(FatalError, match=message):
        resolve_version(spec, AVAILABLE)


def test_nothing_available() -> None:
    with pytest.raises(FatalError, match="no sglang release found at here"):
        resolve_version("latest", ["1.0rc1"], where="at here")


def test_nearest_orders_below_then_above() -> None:
    from packaging.version import Version

    assert nearest_releases(Version("0.5.10.post2"), AVAILABLE, count=1) == [
        "0.5.10.post1",
        "0.5.11",
    ]


def test_file_names_and_pip_tag_options() -> None:
    assert str(file_version("sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl")) == "0.5.11"
    assert str(file_version("sglang-0.5.10.post1.tar.gz")) == "0.5.10.post1"
    assert file_version("other-0.5.9-py3-none-any.whl") is None
    assert file_version("sglang-garbage.whl") is None
    assert target_options("cp312", "manylinux_2_34_x86_64") == [
        "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
        "--platform", "manylinux_2_34_x86_64",
    ]  # fmt: skip
    assert target_options("py3", None) == ["--python-version", "3", "--implementation", "py"]
    with pytest.raises(FatalError, match="not like cp312"):
        target_options("python3.12", None)


def test_fallback_prefers_this_architecture_then_newest_cpython(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import platform

    names = [
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_aarch64.whl",
        "sglang-0.5.23-cp313-cp313-manylinux_2_34_aarch64.whl",
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl",
        "sglang-0.5.23.tar.gz",
    ]
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert fallback_wheel(names) == target_options("cp312", "manylinux_2_34_x86_64")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert fallback_wheel(names) == target_options("cp313", "manylinux_2_34_aarch64")
    assert fallback_wheel(["sglang-0.5.9.tar.gz"]) is None
