"""The four passes of a scan over one worker's share of the files.

1. `exports`: read every file; parse those holding a gate token
   (`semantics.TOKENS`); list what each exports (module-level names derived
   from the architecture: `_device_sm`, `ENABLE_JIT_DEEPGEMM`, ...).
2. `gates`: with every module's exports known, also parse the files without
   tokens that mention an exported public flag (they may import it); find and
   evaluate the gates of every parsed file, and note what flows out of each
   (calls into other modules with the architecture, classes: `flows`).
3. `again`: analyse again the modules those flows reach (a function called
   from elsewhere with the architecture, a class whose base or subclass
   elsewhere assigns an architecture-derived attribute), parsing them first
   if no earlier pass did; at first taking the calls pass two saw as all the
   calls there are.
4. `calls`: for the functions whose module that changed, every call anywhere
   in the share (a parameter is architectural only if every call says so);
   then `again` once more for those modules.

The share (file contents and syntax trees) stays in the worker between the
passes. A file that cannot be parsed or analysed becomes a `ScanProblem`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sm120fork.gates import semantics
from sm120fork.gates.analyze import (
    ModuleResult,
    ParsedModule,
    analyse_module,
    importable,
    module_calls,
    module_exports,
    parse_module,
)
from sm120fork.gates.evaluator import Context
from sm120fork.gates.model import ScanProblem
from sm120fork.gates.scopes import module_name
from sm120fork.gates.values import CallArgs, ExportTable

Files = list[tuple[str, str]]  # (repository-relative path, absolute path)
Calls = dict[tuple[str, str], list[CallArgs]]


@dataclass
class Share:
    """One worker's files and what it found in them (lives in the worker)."""

    data: dict[str, bytes] = field(default_factory=dict)
    parsed: dict[str, ParsedModule] = field(default_factory=dict)
    problems: list[ScanProblem] = field(default_factory=list)
    context: Context = field(default_factory=Context)  # pass two's

    def clear(self) -> None:
        for parsed in self.parsed.values():
            parsed.scopes.dispose()
        self.data.clear()
        self.parsed.clear()
        self.problems.clear()

    def parse(self, relpath: str) -> ParsedModule | None:
        parsed = self.parsed.get(relpath)
        if parsed is None:
            result = parse_module(relpath, self.data[relpath])
            if isinstance(result, ScanProblem):
                self.problems.append(result)
                return None
            parsed = self.parsed[relpath] = result
        return parsed

    def analyse(
        self, relpath: str, parsed: ParsedModule, context: Context, *, outgoing: bool = True
    ) -> ModuleResult | None:
        try:
            return analyse_module(parsed, context, outgoing=outgoing)
        except Exception as error:  # an analysis bug must not hide the other modules' gates
            self.problems.append(_failed(relpath, error))
            return None


def _failed(relpath: str, error: Exception) -> ScanProblem:
    return ScanProblem(relpath, f"cannot analyse: {type(error).__name__}: {error}")


def exports(
    files: Files, modules: frozenset[str], share: Share
) -> tuple[ExportTable, list[ScanProblem]]:
    """Pass one: read the share; parse every file holding a gate token; list its exports."""
    share.clear()
    context = Context(modules=modules)
    tokens = semantics.TOKENS
    table: ExportTable = {}
    for relpath, full in files:
        try:
            with open(full, "rb") as handle:
                data = handle.read()
        except OSError as error:
            share.problems.append(ScanProblem(relpath, f"cannot read: {error}"))
            continue
        share.data[relpath] = data
        if not any(token in data for token in tokens):
            continue
        parsed = share.parse(relpath)
        if parsed is None:
            continue
        try:
            found = module_exports(parsed, context)
        except Exception as error:
            share.problems.append(_failed(relpath, error))
            continue
        table.update(((parsed.scopes.module, name), e) for name, e in found.items())
    return table, list(share.problems)


def gates(context: Context, share: Share) -> tuple[list[ModuleResult], list[ScanProblem]]:
    """Pass two: the gates of the files parsed in pass one, and of files without
    gate tokens that mention an importable public flag (they may import it)."""
    share.context = context
    names = sorted(
        {
            name.encode()
            for (_, name), export in context.exports.items()
            if not name.startswith("_") and importable(name, export)
        }
    )
    for relpath, data in share.data.items():
        if relpath not in share.parsed and any(name in data for name in names):
            share.parse(relpath)
    results = []
    for relpath, parsed in list(share.parsed.items()):
        result = share.analyse(relpath, parsed, context)
        if result is not None:
            results.append(result)
    return results, list(share.problems)  # pass one's problems included


def calls(targets: frozenset[tuple[str, str]], share: Share) -> Calls:
    """Pass three: what the share's calls of `targets` pass them."""
    # A call names the function, and the module it comes from in an import.
    needles = sorted(
        {(name.encode(), module.rsplit(".", 1)[-1].encode()) for module, name in targets}
    )
    found: Calls = {}
    for relpath, data in share.data.items():
        if not any(name in data and module in data for name, module in needles):
            continue
        parsed = share.parse(relpath)
        if parsed is None:
            continue
        try:
            made = module_calls(parsed, share.context, targets)
        except Exception as error:
            share.problems.append(_failed(relpath, error))
            continue
        for target, records in made.items():
            found.setdefault(target, []).extend(records)
    return found


def again(
    argument: tuple[Context, frozenset[str] | None], share: Share
) -> tuple[list[ModuleResult], list[ScanProblem]]:
    """Pass four: the gates of the modules that the flows between modules reach
    (of the modules named in `argument`, if it names any)."""
    context, only = argument
    before = len(share.problems)
    names = sorted(context.providers())
    # `class X(..., Provider, ...)`: a class that may inherit from one of them
    inherits = re.compile(
        rb"class\s+\w+\s*\([^)]*\b(?:%s)\b" % b"|".join(n.encode() for n in names)
    )
    results = []
    for relpath, data in share.data.items():
        module = module_name(relpath)[0]
        if only is not None and module not in only:
            continue
        seeds = context.attr_seeds(module)
        if not (
            context.call_targets(module)
            or any(s.encode() in data for s in seeds)
            or (names and inherits.search(data))
        ):
            continue
        parsed = share.parse(relpath)
        if parsed is not None:
            result = share.analyse(relpath, parsed, context, outgoing=False)
            if result is not None:
                results.append(result)
    return results, share.problems[before:]
