"""The series' own intents (patches/intents.toml) on the vendored tree: every patch has
one, each reproduces its patch byte for byte (what `check` proves), and each still
makes the same program when upstream reformats the code (other quotes, conditions
re-wrapped black-style) or moves it to another module. A file the patch creates is
absent (None) below it, and is made where its intent names it."""

from __future__ import annotations

import ast
from pathlib import Path

import libcst as cst
import pytest
from sm120fork.intent.model import load_intents
from sm120fork.intent.reapply import reapply
from sm120fork.patches.applier import Overlay, apply_patch
from sm120fork.patches.patchfile import load_patch
from sm120fork.patches.series import read_series
from sm120fork.paths import RepoPaths

PATHS = RepoPaths(Path(__file__).resolve().parents[1])
INTENTS = load_intents(PATHS.intents_file)
ENTRIES = read_series(PATHS.series_file).entries
NAMES = [entry.name for entry in ENTRIES]

Case = tuple[dict[str, str | None], dict[str, str]]  # the patch's files before it, and after


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    """Each patch's files on the tree below it, and as the patch leaves them."""
    overlay = Overlay(PATHS.upstream_tree)
    found: dict[str, Case] = {}
    for entry in ENTRIES:
        patch = load_patch(PATHS.patches_dir / entry.name, entry.name, entry.strip)
        before = {path: overlay.read(path) for path in patch.paths}
        apply_patch(overlay, patch)
        found[entry.name] = (before, {path: overlay.read(path) or "" for path in patch.paths})
    return found


@pytest.mark.slow
def test_each_intent_finds_its_code_among_every_module_of_the_tree() -> None:
    """What `rebase` does: no file named, the whole tree searched (5000-odd modules)."""
    overlay = Overlay(PATHS.upstream_tree)
    modules = sorted(
        p.relative_to(PATHS.upstream_tree).as_posix() for p in PATHS.upstream_tree.rglob("*.py")
    )
    for entry in ENTRIES:
        patch = load_patch(PATHS.patches_dir / entry.name, entry.name, entry.strip)
        result = reapply(INTENTS[entry.name], overlay.read, modules)
        apply_patch(overlay, patch)
        assert result.status == "resolved", (entry.name, result.detail)
        assert result.changes == {path: overlay.read(path) for path in patch.paths}, entry.name


def test_every_patch_of_the_series_has_an_intent() -> None:
    assert sorted(INTENTS) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_intent_reproduces_its_patch_exactly(name: str, cases: dict[str, Case]) -> None:
    before, after = cases[name]
    result = reapply(INTENTS[name], before.get, sorted(before))
    assert result.status == "resolved", result.detail
    assert result.changes == after


class Reformat(cst.CSTTransformer):
    """What a formatter may do to upstream's code: single quotes where a string allows,
    and every boolean condition of an `if` or `return` wrapped one operand a line."""

    def leave_SimpleString(
        self, original: cst.SimpleString, updated: cst.SimpleString
    ) -> cst.SimpleString:
        body = updated.value[1:-1]
        plain = updated.value.startswith('"') and not updated.value.startswith('"""')
        if plain and "'" not in body and "\\" not in body:
            return updated.with_changes(value=f"'{body}'")
        return updated

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        return updated.with_changes(test=_wrapped(updated.test))

    def leave_Return(self, original: cst.Return, updated: cst.Return) -> cst.Return:
        value = updated.value
        return updated.with_changes(value=_wrapped(value) if value is not None else None)


def _wrapped(node: cst.BaseExpression) -> cst.BaseExpression:
    if not isinstance(node, cst.BooleanOperation) or node.lpar:
        return node
    newline = cst.ParenthesizedWhitespace(
        first_line=cst.TrailingWhitespace(), indent=True, last_line=cst.SimpleWhitespace("    ")
    )
    operator = node.operator.with_changes(whitespace_before=newline)
    return node.with_changes(
        operator=operator,
        lpar=[cst.LeftParen(whitespace_after=newline)],
        rpar=[cst.RightParen(whitespace_before=newline)],
    )


def _same_program(result: dict[str, str], after: dict[str, str]) -> None:
    assert sorted(result) == sorted(after)
    for path, text in result.items():
        assert ast.dump(ast.parse(text)) == ast.dump(ast.parse(after[path])), path


@pytest.mark.parametrize("name", NAMES)
def test_the_intent_survives_a_reformat(name: str, cases: dict[str, Case]) -> None:
    before, after = cases[name]
    reformatted = {
        p: None if t is None else cst.parse_module(t).visit(Reformat()).code
        for p, t in before.items()
    }
    assert reformatted != before or all(t is None for t in before.values())
    result = reapply(INTENTS[name], reformatted.get, sorted(reformatted))
    assert result.status == "resolved", result.detail
    _same_program(result.changes, after)


def _moved(path: str, before: dict[str, str | None]) -> str:
    """Where upstream's file moved to; a new file has no code to follow and keeps its path."""
    if before[path] is None:
        return path
    return path.replace("python/sglang/", "python/sglang/moved/", 1)


@pytest.mark.parametrize("name", NAMES)
def test_the_intent_follows_its_code_into_other_modules(name: str, cases: dict[str, Case]) -> None:
    before, after = cases[name]
    moved = {_moved(path, before): text for path, text in before.items() if text is not None}
    result = reapply(INTENTS[name], moved.get, sorted(moved))
    assert result.status == "resolved", result.detail
    _same_program(result.changes, {_moved(path, before): text for path, text in after.items()})


def test_a_model_override_moved_into_another_module_is_found_there(
    cases: dict[str, Case],
) -> None:
    """The Olmo2 override pasted into the Exaone module (upstream merging override
    modules): the intent finds it by its registration, edits only it."""
    ((olmo2_path, olmo2),) = cases["sm120-olmo2-attention-triton.patch"][0].items()
    ((exaone_path, exaone),) = cases["sm120-exaone-attention-triton.patch"][0].items()
    assert olmo2 is not None and exaone is not None
    override = olmo2[olmo2.index('@_register_for("Olmo2ForCausalLM")') :]
    merged = {exaone_path: f"{exaone}\n\n{override}", olmo2_path: "# moved\n"}
    result = reapply(INTENTS["sm120-olmo2-attention-triton.patch"], merged.get, sorted(merged))
    assert result.status == "resolved", result.detail
    assert list(result.changes) == [exaone_path]
    new = result.changes[exaone_path]
    assert new.count("is_sm120") == 1
    assert new.index("is_sm120") > new.index('@_register_for("Olmo2ForCausalLM")')
