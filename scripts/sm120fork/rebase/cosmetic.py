"""Two rules of resolutions.py: a re-worded comment, an import both sides changed.

Upstream only re-worded comments.

A 3-way merge conflicts when both sides touch neighbouring lines, even when
upstream's side is only a comment edit next to where the patch adds code
(0.5.10 rewrote `# DeepSeek 3.2, GlmMoeDsaForCausalLM` to `# DeepSeek 3.2/GLM 5`
on the very `if` line the NSA guard inserts under). Such a block is resolved
here, and only such a block:

* ours (new upstream) has the same lines as base (old upstream), line for
  line, once comments and trailing blanks are ignored: same code, same
  indentation, same number of lines;
* the patch (theirs) leaves every line that upstream re-worded as it was.

The result is the patch's side with upstream's wording on the lines the
patch kept.

A one-line docstring counts as a comment here (0.5.23 re-worded the docstring
of `_mla_kv_cache_dtype_checks` right above the TRT-LLM MLA guard).

Both sides changed the same `from M import ...` (0.5.11 wrapped
`deep_gemm_wrapper/configurer.py`'s import of `sglang.srt.utils` in parentheses
and added names; the DeepGEMM patch added `is_sm120_supported`). When each side
of the block is exactly one such statement of the same module, the result is
upstream's statement with the names the patch added (and without those it
removed), in upstream's layout. The same holds for a block of bare `name,`
lines inside one parenthesized import list (0.5.13 and 0.5.19 changed the names
of `configurer.py`'s list right where the DeepGEMM patch added one).
"""

from __future__ import annotations

import ast
import difflib
import io
import re
import textwrap
import tokenize


def reworded_comments(ours: list[str], base: list[str], theirs: list[str]) -> list[str] | None:
    if len(ours) != len(base) or not base:
        return None
    reworded = {n for n, (o, b) in enumerate(zip(ours, base, strict=True)) if o != b}
    if any(_code(ours[n]) != _code(base[n]) for n in reworded):
        return None  # upstream changed code, not just a comment
    merged: list[str] = []
    matcher = difflib.SequenceMatcher(a=base, b=theirs, autojunk=False)
    for tag, b1, b2, t1, t2 in matcher.get_opcodes():
        if tag == "equal":
            merged.extend(ours[b1:b2])  # lines the patch kept: upstream's wording
        elif reworded & set(range(b1, b2)):
            return None  # the patch rewrote a line upstream re-worded too
        else:
            merged.extend(theirs[t1:t2])
    return merged


def _code(line: str) -> str:
    """The line without its comment and trailing blanks; indentation kept (it is code).
    A line that is only a string literal (a one-line docstring) keeps its indentation."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens = []
    significant = [t for t in tokens if t.type not in _LAYOUT]
    if len(significant) == 1 and significant[0].type == tokenize.STRING:
        return line[: len(line) - len(line.lstrip())] + '"""docstring"""'
    comments = [t for t in tokens if t.type == tokenize.COMMENT]
    if not comments:
        return line.rstrip()  # no comment, or a line tokenize cannot read alone
    return line[: comments[0].start[1]].rstrip()


_LAYOUT = {
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.NEWLINE,
    tokenize.NL,
    tokenize.ENDMARKER,
    tokenize.COMMENT,
}
_NAME_LINE = re.compile(r"^(\s+)([A-Za-z_]\w*(?: as [A-Za-z_]\w*)?),[ \t]*\n?$")


def merged_import_names(ours: list[str], base: list[str], theirs: list[str]) -> list[str] | None:
    """Blocks of `    name,` lines inside one parenthesized import list."""
    sides = []
    for side in (ours, base, theirs):
        matches = [_NAME_LINE.match(line) for line in side]
        if any(m is None for m in matches):
            return None
        sides.append([m.group(2) for m in matches if m is not None])
    o_names, b_names, t_names = sides
    if not (ours or theirs):
        return None
    added = [name for name in t_names if name not in b_names and name not in o_names]
    removed = {name for name in b_names if name not in t_names}
    names = [name for name in o_names if name not in removed]
    names = sorted(names + added) if sorted(o_names) == o_names else names + added
    sample = (ours or theirs)[0]
    indent = sample[: len(sample) - len(sample.lstrip())]
    return [f"{indent}{name},\n" for name in names]


def merged_import(ours: list[str], base: list[str], theirs: list[str]) -> list[str] | None:
    sides = [_import_from("".join(side)) for side in (ours, base, theirs)]
    if any(side is None for side in sides):
        return None
    (o_mod, o_names), (b_mod, b_names), (t_mod, t_names) = sides  # type: ignore[misc]
    if not o_mod == b_mod == t_mod:
        return None
    added = [name for name in t_names if name not in b_names and name not in o_names]
    removed = {name for name in b_names if name not in t_names}
    names = [name for name in o_names if name not in removed]
    if sorted(o_names) == o_names:  # upstream keeps the list sorted (isort): so do we
        names = sorted(names + added)
    else:
        names += added
    indent = ours[0][: len(ours[0]) - len(ours[0].lstrip())]
    one_line = f"{indent}from {o_mod} import {', '.join(names)}\n"
    if len(ours) == 1 and len(one_line) <= 89:
        return [one_line]
    return [
        f"{indent}from {o_mod} import (\n",
        *(f"{indent}    {name},\n" for name in names),
        f"{indent})\n",
    ]


def _import_from(text: str) -> tuple[str, list[str]] | None:
    """(module with its leading dots, names as written) of a block that is exactly one
    `from M import ...` statement, or None."""
    try:
        body = ast.parse(textwrap.dedent(text)).body
    except SyntaxError:
        return None
    statement = body[0] if len(body) == 1 else None
    if not isinstance(statement, ast.ImportFrom) or statement.module is None:
        return None
    names = [
        f"{alias.name} as {alias.asname}" if alias.asname else alias.name
        for alias in statement.names
    ]
    return "." * statement.level + statement.module, names
