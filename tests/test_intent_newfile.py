"""The `new_file` edit: a module the patch creates, its whole text in the intent. Made
where the tree has no file at its path, already made where the tree has that text,
a conflict where the tree has another file there; the other edits of its intent
still land in their modules."""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path

import pytest
from sm120fork.errors import FatalError
from sm120fork.intent import proofcache, renames
from sm120fork.intent.model import Intent, parse_intent
from sm120fork.intent.reapply import reapply

NEW = "python/sglang/srt/layers/helper.py"
OLD = "python/sglang/srt/runner.py"
HELPER = 'def helper():\n    return "sm120"\n'
RUNNER = "def run():\n    return 1\n"


def _intent(edits: str) -> Intent:
    text = f'[[intent]]\npatch = "p.patch"\nsays = "test"\n{textwrap.dedent(edits)}'
    return parse_intent(tomllib.loads(text)["intent"][0], "test")


INTENT = _intent(f"""
    [[intent.edit]]
    new_file = "{NEW}"
    code = '''
    {HELPER.replace(chr(10), chr(10) + "    ")}'''

    [[intent.edit]]
    function = "run"
    insert_at = "top"
    code = '''
    from sglang.srt.layers.helper import helper
    '''
""")


def test_the_intent_holds_the_whole_text_of_the_new_file() -> None:
    (created, _) = INTENT.edits
    assert (created.scope, created.name, created.code) == ("new_file", NEW, HELPER)


def test_a_new_file_is_made_where_the_tree_has_none_beside_the_other_edits() -> None:
    tree = {OLD: RUNNER}
    result = reapply(INTENT, tree.get, sorted(tree))
    assert result.status == "resolved", result.detail
    assert result.changes == {
        NEW: HELPER,
        OLD: "def run():\n    from sglang.srt.layers.helper import helper\n    return 1\n",
    }


def test_another_file_at_its_path_is_a_conflict() -> None:
    tree = {OLD: RUNNER, NEW: "x = 1\n"}
    result = reapply(INTENT, tree.get, sorted(tree))
    assert result.status == "not-found" and result.changes == {}
    assert f"new file {NEW}: the tree already has another file there" in result.detail


def test_an_empty_file_at_its_path_is_a_file_too() -> None:
    tree = {OLD: RUNNER, NEW: ""}
    assert reapply(INTENT, tree.get, sorted(tree)).status == "not-found"


def test_the_same_file_upstream_is_already_made() -> None:
    only = _intent(f"""
        [[intent.edit]]
        new_file = "{NEW}"
        code = "x = 1\\n"
    """)
    tree = {NEW: "x = 1\n"}
    result = reapply(only, tree.get, sorted(tree))
    assert result.status == "upstreamed", result.detail
    assert f"new file {NEW}: upstream has it" in result.detail
    with_edit = reapply(INTENT, {OLD: RUNNER, NEW: HELPER}.get, [OLD, NEW])
    assert with_edit.status == "resolved" and list(with_edit.changes) == [OLD]


def test_the_new_module_binds_no_name_in_another_module() -> None:
    """Its code reaches another module only through an import the intent writes."""
    bare = _intent(f"""
        [[intent.edit]]
        new_file = "{NEW}"
        code = '''
        {HELPER.replace(chr(10), chr(10) + "        ")}'''

        [[intent.edit]]
        function = "run"
        insert_at = "top"
        code = "helper()"
    """)
    result = reapply(bare, {OLD: RUNNER}.get, [OLD])
    assert result.status == "not-found"
    assert "its new code reads helper, which def run lacks" in result.detail


def test_the_proof_cache_reads_the_new_path_though_no_candidate_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebase's candidates are its modules: a file there of another kind still counts."""
    monkeypatch.setenv("SM120FORK_INTENT_CACHE", str(tmp_path))
    tree = {OLD: RUNNER, NEW: "x = 1\n"}
    assert proofcache.reapply_kept(INTENT, tree.get, [OLD]).status == "not-found"
    del tree[NEW]
    assert proofcache.reapply_kept(INTENT, tree.get, [OLD]).status == "resolved"


def test_a_followed_rename_changes_the_code_not_the_path() -> None:
    renamed = renames.applied(INTENT, {"helper": "assist"})
    assert renamed.edits[0].name == NEW
    assert renamed.edits[0].code == HELPER.replace("helper", "assist")


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (f'new_file = "{NEW}"\nfunction = "run"\ncode = "x = 1"', "has only `code`"),
        (f'new_file = "{NEW}"', "must be strings"),
        ('new_file = "../setup.py"\ncode = "x = 1"', "relative path inside the tree"),
        ('new_file = "/etc/x.py"\ncode = "x = 1"', "relative path inside the tree"),
        ('new_file = "python//x.py"\ncode = "x = 1"', "relative path inside the tree"),
    ],
)
def test_a_malformed_new_file_is_refused(edit: str, says: str) -> None:
    with pytest.raises(FatalError, match=says):
        _intent(f"[[intent.edit]]\n{edit}\n")
