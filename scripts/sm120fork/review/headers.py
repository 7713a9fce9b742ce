"""DEP-3 header changes of a patch: subject, description, evidence, dates."""

from __future__ import annotations

from sm120fork.patches.dep3 import Dep3Header
from sm120fork.review.model import FieldChange


def _bugs(header: Dep3Header) -> str:
    return ", ".join(
        f.value.strip()
        for f in header.fields
        if f.name.lower() == "bug" or f.name.lower().startswith("bug-")
    )


def _field(header: Dep3Header, *names: str) -> str:
    found = header.get(*names)
    return found.value.strip() if found else ""


def fields(header: Dep3Header) -> dict[str, str]:
    """The fields a reviewer compares, each as one string ("" when absent)."""
    return {
        "Subject": header.subject,
        "Description": header.description,
        "Author": _field(header, "From", "Author"),
        "Origin": _field(header, "Origin"),
        "Bug": _bugs(header),
        "Forwarded": _field(header, "Forwarded"),
        "Last-Update": _field(header, "Last-Update"),
    }


def header_changes(old: Dep3Header, new: Dep3Header) -> tuple[FieldChange, ...]:
    before, after = fields(old), fields(new)
    return tuple(
        FieldChange(name, before[name] or None, after[name] or None)
        for name in before
        if before[name] != after[name]
    )
