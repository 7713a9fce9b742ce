"""The intent-proof cache (issue 20): a proof of bytes proved before is the kept result,
any changed byte, intent or tool source is another key, a damaged entry is a miss,
and a cache that cannot be written is no error."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from intentcase import INTENT, WITH_DEEPSEEK
from sm120fork.intent import proofcache
from sm120fork.intent.model import Intent
from sm120fork.intent.reapply import Reapplied, reapply

SERVER_ARGS = "python/sglang/srt/server_args.py"
FILES: dict[str, str | None] = {SERVER_ARGS: WITH_DEEPSEEK}


@pytest.fixture
def proofs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The cache in a fresh folder; the paths every uncached proof was made of."""
    monkeypatch.setenv("SM120FORK_INTENT_CACHE", str(tmp_path / "proofs"))
    made: list[str] = []

    def counted(
        intent: Intent, read: Callable[[str], str | None], candidates: Iterable[str]
    ) -> Reapplied:
        paths = list(candidates)
        made.append(",".join(paths))
        return reapply(intent, read, paths)

    monkeypatch.setattr(proofcache, "reapply", counted)
    return made


def _prove(files: dict[str, str | None] = FILES, intent: Intent = INTENT) -> Reapplied:
    return proofcache.reapply_kept(intent, files.get, sorted(files))


def _entries() -> list[Path]:
    return sorted(proofcache._ENTRIES.directory().glob("*.json.z"))


def test_the_same_bytes_are_proved_once(proofs: list[str]) -> None:
    first = _prove()
    assert first.status == "resolved" and len(proofs) == 1 and len(_entries()) == 1
    again = _prove(dict(FILES))  # another reader, the same bytes
    assert again == first and len(proofs) == 1
    assert again == reapply(INTENT, FILES.get, sorted(FILES))  # what an uncached proof says


def test_a_changed_byte_or_intent_is_another_proof(proofs: list[str]) -> None:
    _prove()
    _prove({SERVER_ARGS: WITH_DEEPSEEK + "\n# a trailing comment\n"})
    _prove({**FILES, "python/sglang/other.py": None})  # one more candidate, absent
    _prove(intent=replace(INTENT, says="another description"))
    assert len(proofs) == 4 and len(_entries()) == 4


def test_the_key_covers_the_tool_source(proofs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    before = proofcache.proof_key(INTENT, dict(FILES))
    monkeypatch.setattr(proofcache, "tool_version", lambda: "another build of the tool")
    assert proofcache.proof_key(INTENT, dict(FILES)) != before


@pytest.mark.parametrize("damage", [b"", b"garbage", proofcache._MAGIC + b"0" * 64 + b"\nx"])
def test_a_damaged_entry_is_a_miss_and_is_replaced(proofs: list[str], damage: bytes) -> None:
    first = _prove()
    (entry,) = _entries()
    entry.write_bytes(damage)
    assert _prove() == first and len(proofs) == 2
    assert _prove() == first and len(proofs) == 2  # the replaced entry answers


def test_a_cache_that_cannot_be_written_is_no_error(
    proofs: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SM120FORK_INTENT_CACHE", str(blocker / "proofs"))
    assert _prove().status == "resolved"
    assert _prove().status == "resolved" and len(proofs) == 2
