"""Conflicts a person would resolve without thinking: upstream only re-worded comments.

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
patch kept. Anything else stays a conflict for a person.
"""

from __future__ import annotations

import difflib
import io
import tokenize

from sm120fork.lines import split_lines


def resolve_text(text: str) -> str | None:
    """`text` (a file with diff3 conflict blocks) with every block resolved, or None
    when some block is more than a comment edit next to the patch."""
    out: list[str] = []
    lines = split_lines(text)
    i = 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            out.append(lines[i])
            i += 1
            continue
        sides: dict[str, list[str]] = {"ours": [], "base": [], "theirs": []}
        side = "ours"
        i += 1
        while i < len(lines) and not lines[i].startswith(">>>>>>> "):
            if lines[i].startswith("||||||| "):
                side = "base"
            elif lines[i].rstrip("\n") == "=======":
                side = "theirs"
            else:
                sides[side].append(lines[i])
            i += 1
        if i == len(lines):
            return None  # an unterminated block: not ours to guess
        merged = resolve_block(sides["ours"], sides["base"], sides["theirs"])
        if merged is None:
            return None
        out.extend(merged)
        i += 1
    return "".join(out)


def resolve_block(ours: list[str], base: list[str], theirs: list[str]) -> list[str] | None:
    """The merged lines of one conflict block, or None (see the module docstring)."""
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
    """The line without its comment and trailing blanks; indentation kept (it is code)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens = []
    comments = [t for t in tokens if t.type == tokenize.COMMENT]
    if not comments:
        return line.rstrip()  # no comment, or a line tokenize cannot read alone
    return line[: comments[0].start[1]].rstrip()
