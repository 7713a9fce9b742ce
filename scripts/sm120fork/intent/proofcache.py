"""Intent proofs and re-applications already made, kept by what they read.

`check` proves every intent by re-applying it to the tree below its patch and
comparing with the patch (patches/checks.py). A proof parses the patched modules
with libcst: most of `check`'s time, and of a rebase's start (which checks
first) and end (which checks the new base). The same fork is checked again and
again with the same bytes, so a proof's result is kept under the user's cache
directory (`$XDG_CACHE_HOME/sglang-sm120/intent-proofs/`, `~/.cache/...`
without it; `$SM120FORK_INTENT_CACHE` names another), named by a key over the
tool's own source (every module of sm120fork), the Python and libcst versions,
the intent, and each candidate file's path and git blob id (or its absence).
Any changed byte of any of these is another key, so an entry is never stale.
The payload is JSON (zlib): the re-application's status, detail and new texts.
The rebase keeps its re-applications the same way (rebase/merge.py): there the
candidates are every module of the work tree, whose blob ids cost a tenth of
a re-application.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import zlib
from collections.abc import Callable, Iterable
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import libcst as cst

from sm120fork.fsutil import CacheDir
from sm120fork.intent.model import NEW_FILE, Intent
from sm120fork.intent.reapply import Reapplied, reapply

_MAGIC = b"sm120fork-intent-proof 1\n"
_TOOL = Path(__file__).resolve().parents[1]  # the sm120fork package
# A proof holds the new text of each file it changes (server_args.py is 400 KB,
# about 80 KB compressed): 512 entries are a few series of a few releases.
_ENTRIES = CacheDir("intent-proofs", "SM120FORK_INTENT_CACHE", _MAGIC, ".json.z", 512)


@cache
def tool_version() -> str:
    try:
        libcst = version("libcst")
    except PackageNotFoundError:  # imported from a path, not installed: its place stands in
        libcst = str(Path(cst.__file__).resolve().parent)
    digest = hashlib.sha256(f"{sys.version}\0libcst {libcst}\0".encode())
    for path in sorted(_TOOL.rglob("*.py")):
        digest.update(path.relative_to(_TOOL).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _blob_id(text: str | None) -> str:
    if text is None:
        return "absent"
    data = text.encode("utf-8", "surrogatepass")
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def proof_key(intent: Intent, texts: dict[str, str | None]) -> str:
    """The key of re-applying `intent` to `texts` (path -> text, in candidate order)."""
    digest = hashlib.sha256(tool_version().encode())
    digest.update(json.dumps(dataclasses.asdict(intent), sort_keys=True).encode() + b"\0")
    for path, text in texts.items():
        digest.update(path.encode("utf-8", "surrogateescape") + b"\0" + _blob_id(text).encode())
    return digest.hexdigest()


def reapply_kept(
    intent: Intent, read: Callable[[str], str | None], candidates: Iterable[str]
) -> Reapplied:
    """`reapply(intent, read, candidates)`, from the cache when these bytes were proved
    before. Every candidate is read first (reapply reads them all anyway), and the
    path of each file the intent creates (what is there decides the result)."""
    created = [edit.name for edit in intent.edits if edit.scope == NEW_FILE]
    texts = {path: read(path) for path in dict.fromkeys([*candidates, *created])}
    key = proof_key(intent, texts)
    kept = _load(key)
    if kept is not None:
        return kept
    result = reapply(intent, texts.get, texts)
    payload = {"status": result.status, "detail": result.detail, "changes": result.changes}
    _ENTRIES.store(key, zlib.compress(json.dumps(payload).encode(), 6))
    return result


def _load(key: str) -> Reapplied | None:
    payload = _ENTRIES.load(key)
    if payload is None:
        return None
    try:
        data = json.loads(zlib.decompress(payload))
        changes = {str(path): str(text) for path, text in data["changes"].items()}
        return Reapplied(str(data["status"]), str(data["detail"]), changes)
    except (ValueError, KeyError, TypeError, AttributeError, zlib.error):
        return None  # a damaged or foreign entry: a miss
