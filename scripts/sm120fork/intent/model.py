"""The intent records and `patches/intents.toml`.

An intent is the recipe behind one patch: a list of edits, each naming where
(a scope found by meaning, in whatever module it now lives) and what (one
operation and its code). For example:

[[intent]]
patch = "sm120-olmo2-attention-triton.patch"
says = "The Olmo2 override defaults SM12x to triton"

[[intent.edit]]
model = "Olmo2ForCausalLM"    # the override registered for this architecture
add_elif_after = "get_platform().is_cuda and get_platform().is_sm100"
code = '''
elif get_platform().is_cuda and get_platform().is_sm120:
    overrides["attention_backend"] = "triton"
'''

Scopes (one per edit): `function` (a def by qualified name, `Class.method`),
`class` (a class by qualified name: its fields), `model` (the function a
decorator registers for an architecture, or the `if` branch whose test names
it), `module_of` (the module that defines a name). Operations (one per edit):
`insert_at` ("top", after the docstring, or "end"), `insert_after` /
`insert_before` (a statement), `refuse_at` / `refuse_after` / `refuse_before`
(the same, for code that raises), `add_elif_after` (a branch condition),
`add_branch_before` (a new first branch: the old `if` becomes `elif`),
`comment_after` (comment lines after the comment line given), `condition` (the
`if` whose test this is gets test `by`), `replace` (an expression or statement
becomes `by`), `import_beside` (a `from` import of `name` next to this one).
A new module is an edit of its own, `new_file = "python/sglang/x.py"` with
`code` its whole text: made where the tree has no file there, already made where
it has that text, and a conflict (not-found) where it has another.
Statements and conditions are matched by their syntax tree, so formatting and
quotes do not matter.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sm120fork.errors import FatalError

SCOPES = ("function", "class", "model", "module_of")
# Operation key -> the key holding its code.
OPERATIONS = {
    "insert_at": "code",
    "insert_after": "code",
    "insert_before": "code",
    "refuse_at": "code",
    "refuse_after": "code",
    "refuse_before": "code",
    "add_elif_after": "code",
    "add_branch_before": "code",
    "comment_after": "code",
    "condition": "by",
    "replace": "by",
    "import_beside": "name",
}
OPTIONS = ("within", "holding", "comment", "count", "paragraph")
NEW_FILE = "new_file"  # both scope and operation of an edit that creates a file


@dataclass(frozen=True)
class Edit:
    scope: str  # one of SCOPES, or NEW_FILE
    name: str  # what the scope is found by
    op: str  # one of OPERATIONS
    target: str  # the operation's anchor: a statement, condition, expression or name
    code: str  # the new code (or the imported name)
    within: str = ""  # narrow the scope to the body of `if <within>`
    holding: str = ""  # the target `if` is the one whose body holds this statement
    comment: str = ""  # `condition`: comment lines put above the `if`
    count: int = 0  # `replace`: exactly this many occurrences (0: at least one)
    paragraph: bool = False  # inserted code set off by blank lines, as the anchor's neighbours

    def where(self) -> str:
        label = {
            "function": "def",
            "class": "class",
            "model": "the override for",
            "module_of": "the module of",
            NEW_FILE: "new file",
        }
        return f"{label[self.scope]} {self.name}"


@dataclass(frozen=True)
class Intent:
    patch: str
    says: str
    edits: tuple[Edit, ...]
    # Why the recipe no longer reproduces its patch (a landing found it describes the
    # old code): `check` does not prove it, and names it.
    stale: str = ""


def load_intents(path: Path) -> dict[str, Intent]:
    """Intents by patch name; an absent file means no patch declares one."""
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise FatalError(f"{path} is not valid TOML ({error}); fix the file") from error
    intents: dict[str, Intent] = {}
    for index, raw in enumerate(data.get("intent", []), start=1):
        intent = parse_intent(raw, f"{path.name} intent #{index}")
        if intent.patch in intents:
            raise FatalError(f"{path.name}: {intent.patch} has two intents; merge them")
        intents[intent.patch] = intent
    return intents


def parse_intent(raw: dict[str, object], where: str) -> Intent:
    def text(key: str) -> str:
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            raise FatalError(f"{where}: `{key}` must be a non-empty string")
        return value

    edits = raw.get("edit", [])
    if not isinstance(edits, list) or not edits:
        raise FatalError(f"{where}: needs at least one [[intent.edit]]")
    parsed = tuple(_edit(item, f"{where} edit #{n}") for n, item in enumerate(edits, start=1))
    stale = raw.get("stale", "")
    if not isinstance(stale, str):
        raise FatalError(f"{where}: `stale` must be a string")
    return Intent(patch=text("patch"), says=text("says"), edits=parsed, stale=stale)


def _edit(raw: object, where: str) -> Edit:
    if not isinstance(raw, dict):
        raise FatalError(f"{where}: must be a table")
    if NEW_FILE in raw:
        return _new_file(raw, where)
    scopes = [key for key in SCOPES if key in raw]
    ops = [key for key in OPERATIONS if key in raw]
    if len(scopes) != 1 or len(ops) != 1:
        raise FatalError(
            f"{where}: needs exactly one scope ({', '.join(SCOPES)}) "
            f"and one operation ({', '.join(OPERATIONS)})"
        )
    scope, op = scopes[0], ops[0]
    known = {scope, op, OPERATIONS[op], *OPTIONS}
    if unknown := sorted(set(raw) - known):
        raise FatalError(f"{where}: unknown key {', '.join(unknown)}")
    values = {key: raw.get(key, "") for key in (scope, op, OPERATIONS[op], *OPTIONS[:3])}
    for key, value in values.items():
        if not isinstance(value, str):
            raise FatalError(f"{where}: `{key}` must be a string")
    for key in (scope, op, OPERATIONS[op]):
        if not str(values[key]).strip():
            raise FatalError(f"{where}: `{key}` must be a non-empty string")
    count = raw.get("count", 0)
    if not isinstance(count, int) or count < 0:
        raise FatalError(f"{where}: `count` must be a positive integer")
    paragraph = raw.get("paragraph", False)
    if not isinstance(paragraph, bool):
        raise FatalError(f"{where}: `paragraph` must be true or false")
    if op.endswith("_at") and values[op] not in ("top", "end"):
        raise FatalError(f'{where}: `{op}` must be "top" or "end"')
    return Edit(
        scope=scope,
        name=str(values[scope]),
        op=op,
        target=str(values[op]),
        code=str(values[OPERATIONS[op]]),
        within=str(values["within"]),
        holding=str(values["holding"]),
        comment=str(values["comment"]),
        count=count,
        paragraph=paragraph,
    )


def _new_file(raw: dict[str, object], where: str) -> Edit:
    if unknown := sorted(set(raw) - {NEW_FILE, "code"}):
        raise FatalError(f"{where}: a `{NEW_FILE}` edit has only `code`, not {', '.join(unknown)}")
    path, code = raw.get(NEW_FILE), raw.get("code")
    if not isinstance(path, str) or not isinstance(code, str):
        raise FatalError(f"{where}: `{NEW_FILE}` and `code` must be strings")
    parts = PurePosixPath(path).parts
    if not parts or path != PurePosixPath(path).as_posix() or path.startswith("/") or ".." in parts:
        raise FatalError(f"{where}: `{NEW_FILE}` must be a relative path inside the tree")
    return Edit(scope=NEW_FILE, name=path, op=NEW_FILE, target=path, code=code)
