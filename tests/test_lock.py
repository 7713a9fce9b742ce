"""vendor/sglang.lock: stable hand-written TOML that tomllib reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
from sm120fork.errors import FatalError
from sm120fork.upstream import lock

SHA_A, SHA_B = "a" * 64, "b" * 64

PYPI = lock.Lock(
    version="0.5.11",
    tag="v0.5.11",
    source="pypi",
    imported="2026-02-03",
    tree_from="sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl",
    license_from="sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl:"
    "sglang-0.5.11.dist-info/licenses/LICENSE",
    skipped=("python/sglang/srt/grpc/_core.so", 'python/sglang/a "quoted"\\name'),
    artifacts=(
        lock.Artifact("sglang-0.5.11-cp312-cp312-manylinux_2_34_x86_64.whl", SHA_B, 7307932),
        lock.Artifact("sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl", SHA_A, None),
    ),
)

EXPECTED = f"""\
# Provenance of vendor/sglang: written by `sm120fork import`, never edited by hand.
version = "0.5.11"
tag = "v0.5.11"
source = "pypi"
imported = "2026-02-03"
tree_from = "sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl"
license_from = "sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl:sglang-0.5.11.dist-info/licenses/LICENSE"
skipped = [
    "python/sglang/a \\"quoted\\"\\\\name",
    "python/sglang/srt/grpc/_core.so",
]

[[artifacts]]
file = "sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl"
sha256 = "{SHA_A}"

[[artifacts]]
file = "sglang-0.5.11-cp312-cp312-manylinux_2_34_x86_64.whl"
sha256 = "{SHA_B}"
size = 7307932
"""  # noqa: E501


def test_dumps_is_stable_and_sorted() -> None:
    assert lock.dumps(PYPI) == EXPECTED


def test_round_trip_pypi_and_git() -> None:
    parsed = lock.loads(lock.dumps(PYPI))
    assert parsed.artifacts == tuple(sorted(PYPI.artifacts, key=lambda a: a.file))
    assert parsed.skipped == tuple(sorted(PYPI.skipped))
    assert parsed.artifact(SHA_A) is None
    git = lock.Lock(
        version="0.5.9",
        tag="v0.5.9",
        source="git",
        imported="2026-02-03",
        tree_from="c" * 40,
        license_from="c" * 40 + ":LICENSE",
        url="https://example.com/sglang.git",
        commit="c" * 40,
        skipped=("ctl\x01\x7f", "tab\there"),
    )
    assert lock.loads(lock.dumps(git)) == git


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version = ", "not valid TOML"),
        ('source = "pypi"', "`version` must be a non-empty string"),
        (lock.dumps(PYPI).replace('source = "pypi"', 'source = "ftp"'), "`source` must be"),
        (lock.dumps(PYPI).replace("2026-02-03", "yesterday"), "`imported` must be a date"),
        (lock.dumps(PYPI).replace(SHA_A, "XYZ"), "needs a lowercase hex `sha256`"),
        (lock.dumps(PYPI).replace('source = "pypi"', 'source = "git"'), "`url` must be"),
        (lock.dumps(PYPI).replace("size = 7307932", "size = -1"), "bad `size`"),
    ],
)
def test_malformed_locks_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(FatalError, match=message) as error:
        lock.loads(text)
    assert "re-run `sm120fork import VERSION`" in error.value.message


def test_read_missing_lock_is_none(tmp_path: Path) -> None:
    assert lock.read(tmp_path / "sglang.lock") is None
    (tmp_path / "sglang.lock").write_text(lock.dumps(PYPI))
    assert lock.read(tmp_path / "sglang.lock") == lock.loads(lock.dumps(PYPI))


def test_date_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lock.DATE_ENV, "2026-02-03")
    assert lock.today() == "2026-02-03"
    for bad in ("20260203", "2026-02-30", "soon"):
        monkeypatch.setenv(lock.DATE_ENV, bad)
        with pytest.raises(FatalError, match="YYYY-MM-DD"):
            lock.today()
    monkeypatch.delenv(lock.DATE_ENV)
    assert len(lock.today()) == 10
