"""DEP-3 patch headers (https://dep-team.pages.debian.net/deps/dep3/).

The fork writes them in the `From:` / `Subject:` form so the same file is an
email that `git am` takes on upstream's repository:

    From: Name <mail>
    Subject: [PATCH] short subject

    A paragraph saying what and why.

    Origin: vendor
    Bug: https://github.com/sgl-project/sglang/issues/15650
    Forwarded: no
    Last-Update: 2026-11-29

The header text is kept verbatim; parsing only reads it.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

_FIELD = re.compile(r"([A-Za-z][A-Za-z0-9-]*):(?:[ \t]+(.*)|)$")
_KNOWN = {
    "description",
    "subject",
    "author",
    "from",
    "origin",
    "bug",
    "forwarded",
    "last-update",
    "applied-upstream",
    "reviewed-by",
    "acked-by",
    "signed-off-by",
}
_URL = re.compile(r"https?://\S+")
_ORIGIN_KINDS = ("upstream", "backport", "vendor", "other")
_SINGLE = ("description", "subject", "author", "from", "origin", "forwarded", "last-update")


def _is_field_name(name: str) -> bool:
    lowered = name.lower()
    return lowered in _KNOWN or lowered.startswith(("bug-", "x-"))


@dataclass(frozen=True)
class Field:
    name: str  # as written
    value: str  # continuation lines joined with "\n"
    lineno: int


@dataclass(frozen=True)
class HeaderProblem:
    lineno: int
    message: str


@dataclass(frozen=True)
class Dep3Header:
    raw: str
    fields: tuple[Field, ...]
    body: str  # free text that is not a field: the long description

    def get(self, *names: str) -> Field | None:
        wanted = {name.lower() for name in names}
        return next((f for f in self.fields if f.name.lower() in wanted), None)

    def get_all(self, name: str) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.name.lower() == name.lower())

    @property
    def subject(self) -> str:
        field = self.get("Subject", "Description")
        if field is None:
            return ""
        first = field.value.split("\n", 1)[0].strip()
        return re.sub(r"^\[PATCH[^\]]*\]\s*", "", first)

    @property
    def description(self) -> str:
        """The long description: Description's continuation lines, or the body."""
        field = self.get("Description")
        if field is not None and "\n" in field.value:
            return field.value.split("\n", 1)[1].strip()
        return self.body.strip()

    def with_last_update(self, date: str) -> Dep3Header:
        """The header with its Last-Update value replaced (or added)."""
        field = self.get("Last-Update")
        if field is None:
            raw = self.raw.rstrip("\n") + f"\nLast-Update: {date}\n"
        else:
            lines = self.raw.split("\n")
            lines[field.lineno - 1] = f"{field.name}: {date}"
            raw = "\n".join(lines)
        return parse_header(raw)


def parse_header(raw: str) -> Dep3Header:
    fields: list[Field] = []
    body: list[str] = []
    current: tuple[str, list[str], int] | None = None
    for lineno, line in enumerate(raw.split("\n"), start=1):
        match = _FIELD.match(line)
        if match and _is_field_name(match.group(1)):
            if current:
                fields.append(Field(current[0], "\n".join(current[1]), current[2]))
            current = (match.group(1), [(match.group(2) or "").strip()], lineno)
        elif current and line[:1] in (" ", "\t") and line.strip():
            current[1].append(line.strip())
        else:
            if current:
                fields.append(Field(current[0], "\n".join(current[1]), current[2]))
                current = None
            body.append(line)
    if current:
        fields.append(Field(current[0], "\n".join(current[1]), current[2]))
    return Dep3Header(raw=raw, fields=tuple(fields), body="\n".join(body))


def validate(header: Dep3Header) -> list[HeaderProblem]:
    """Every missing or malformed field the fork requires."""
    problems: list[HeaderProblem] = []

    def problem(field: Field | None, message: str) -> None:
        problems.append(HeaderProblem(field.lineno if field else 1, message))

    for name in _SINGLE:
        repeated = [f for f in header.fields if f.name.lower() == name]
        if len(repeated) > 1:
            problem(repeated[1], f"DEP-3 field {repeated[1].name} appears more than once")

    subject_field = header.get("Subject", "Description")
    if subject_field is None or not header.subject:
        problem(subject_field, "missing DEP-3 Description (or Subject): add a one-line subject")
    elif len(header.subject) > 100:
        problem(subject_field, "DEP-3 subject is longer than 100 characters; shorten it")
    if subject_field is not None and not header.description:
        problem(subject_field, "missing description paragraph after the subject: say what and why")

    author = header.get("Author", "From")
    if author is None or not author.value.strip():
        problem(author, "missing DEP-3 Author (or From): add 'From: Name <mail>'")
    elif not re.fullmatch(r"[^<>\n]+<[^<>\s]+@[^<>\s]+>", author.value.strip()):
        problem(author, f"DEP-3 {author.name} must read 'Name <mail>', got {author.value!r}")

    origin = header.get("Origin")
    if origin is None:
        problem(None, "missing DEP-3 Origin: use 'vendor' or an upstream URL")
    elif not _valid_origin(origin.value):
        problem(
            origin,
            f"DEP-3 Origin {origin.value!r} must be vendor/upstream/backport/other "
            "(optionally ', URL') or a URL",
        )

    for bug in (
        *header.get_all("Bug"),
        *(f for f in header.fields if f.name.lower().startswith("bug-")),
    ):
        if not _URL.fullmatch(bug.value.strip()):
            problem(bug, f"DEP-3 {bug.name} must be a URL, got {bug.value!r}")

    forwarded = header.get("Forwarded")
    if forwarded is None:
        problem(None, "missing DEP-3 Forwarded: use 'no', 'not-needed' or the upstream PR URL")
    elif forwarded.value.strip().lower() not in ("no", "not-needed", "yes") and not _URL.fullmatch(
        forwarded.value.strip()
    ):
        problem(forwarded, f"DEP-3 Forwarded {forwarded.value!r} must be no, not-needed or a URL")

    updated = header.get("Last-Update")
    if updated is None:
        problem(None, "missing DEP-3 Last-Update: add 'Last-Update: YYYY-MM-DD'")
    elif not _valid_date(updated.value.strip()):
        problem(updated, f"DEP-3 Last-Update {updated.value!r} is not a YYYY-MM-DD date")
    return problems


def _valid_origin(value: str) -> bool:
    value = value.strip()
    if _URL.fullmatch(value):
        return True
    kind, _, rest = value.partition(",")
    if kind.strip().lower() not in _ORIGIN_KINDS:
        return False
    return not rest.strip() or bool(re.fullmatch(r"\S+", rest.strip()))


def _valid_date(value: str) -> bool:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
        return False
    try:
        dt.date.fromisoformat(value)
    except ValueError:
        return False
    return True
