"""Inventory a tree: `scan_tree(root) -> Inventory`.

Two passes over the files, split between worker processes that keep their
share of the files (and their syntax trees) in memory between the passes:

1. read every file; a file containing none of the gate tokens
   (`semantics.TOKENS`) cannot hold a gate and is not parsed. Parse the rest
   and list what each exports: module-level names derived from the
   architecture (`_device_sm`, `ENABLE_JIT_DEEPGEMM`, ...).
2. with every module's exports known, also parse the files without tokens
   that mention an exported public flag (they may import it), then find and
   evaluate the gates of every parsed file.

A file that cannot be parsed or analysed becomes a `ScanProblem`, never a
crash.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sm120fork.errors import FatalError
from sm120fork.gates import semantics
from sm120fork.gates.analyze import (
    ModuleResult,
    ParsedModule,
    analyse_module,
    importable,
    module_exports,
    parse_module,
)
from sm120fork.gates.evaluate import Context
from sm120fork.gates.model import Gate, Inventory, ScanProblem, assign_occurrences
from sm120fork.gates.scopes import module_name
from sm120fork.gates.values import ExportTable

PACKAGE = Path("python") / "sglang"


def package_dir(root: Path) -> Path:
    """`root/python/sglang` (a fork or upstream checkout); `root/sglang` (an unpacked wheel)."""
    for candidate in (root / PACKAGE, root / "sglang"):
        if (candidate / "__init__.py").is_file() or (candidate / "srt").is_dir():
            return candidate
    raise FatalError(f"{root} holds no python/sglang package; give an upstream tree's root")


def list_files(package: Path) -> list[tuple[str, str, int]]:
    """(repository-relative path, absolute path, size) of every Python file, sorted."""
    files: list[tuple[str, str, int]] = []
    pending = [(str(package), PACKAGE.as_posix())]
    while pending:
        directory, rel = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, f"{rel}/{entry.name}"))
                elif entry.name.endswith(".py") and entry.is_file():
                    files.append((f"{rel}/{entry.name}", entry.path, entry.stat().st_size))
    files.sort()
    return files


@dataclass
class _Share:
    """One worker's files and what it found in them (lives in the worker)."""

    data: dict[str, bytes] = field(default_factory=dict)
    parsed: dict[str, ParsedModule] = field(default_factory=dict)
    problems: list[ScanProblem] = field(default_factory=list)

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


def _failed(relpath: str, error: Exception) -> ScanProblem:
    # An analysis bug must not hide the other modules' gates.
    return ScanProblem(relpath, f"cannot analyse: {type(error).__name__}: {error}")


def _pass_one(
    files: list[tuple[str, str]], modules: frozenset[str], share: _Share
) -> tuple[ExportTable, list[ScanProblem]]:
    """Read the share; parse every file holding a gate token; list its exports."""
    share.clear()
    context = Context(modules=modules)
    tokens = semantics.TOKENS
    exports: ExportTable = {}
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
            table = module_exports(parsed, context)
        except Exception as error:
            share.problems.append(_failed(relpath, error))
            continue
        exports.update(((parsed.scopes.module, name), e) for name, e in table.items())
    return exports, list(share.problems)


def _pass_two(context: Context, share: _Share) -> tuple[list[ModuleResult], list[ScanProblem]]:
    """Knowing every module's exports, find the gates: in the files parsed in
    pass one, and in files without gate tokens that mention an importable
    public flag (they may import it)."""
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
    for relpath, parsed in share.parsed.items():
        try:
            results.append(analyse_module(parsed, context))
        except Exception as error:
            share.problems.append(_failed(relpath, error))
    return results, list(share.problems)  # pass one's problems included


def _split(files: list[tuple[str, str, int]], parts: int) -> list[list[tuple[str, str]]]:
    """Deal files out by size so each share holds about as many bytes."""
    shares: list[list[tuple[str, str]]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for rel, full, size in sorted(files, key=lambda f: -f[2]):
        i = loads.index(min(loads))
        shares[i].append((rel, full))
        loads[i] += size
    return shares


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def scan_tree(
    root: Path, *, workers: int | None = None, files: list[tuple[str, str, int]] | None = None
) -> Inventory:
    """Every architecture gate of the sglang tree under `root` (unreviewed); `files`, as
    `list_files` gives them, scans those instead (a tree with some files swapped)."""
    files = list_files(package_dir(root)) if files is None else files
    modules = frozenset(module_name(rel)[0] for rel, _, _ in files)
    count = workers if workers is not None else default_workers()
    count = max(1, min(count, len(files) // 50 or 1))
    shares = _split(files, count)
    collecting = gc.isenabled()
    gc.disable()  # analysis breaks its own cycles; the collector would only slow it down
    try:
        if count == 1:
            results, problems = _serial(shares[0], modules)
        else:
            results, problems = _parallel(shares, modules)
    finally:
        if collecting:
            gc.enable()
    gates: list[Gate] = []
    helpers: set[str] = set()
    for result in results:
        gates.extend(result.gates)
        helpers |= result.unknown_helpers
    return Inventory(
        root=str(root),
        gates=assign_occurrences(gates),
        problems=tuple(sorted(set(problems), key=lambda p: (p.file, p.message))),
        files_total=len(files),
        files_parsed=len(results) + sum(1 for p in problems if "parse" in p.message),
        unknown_helpers=tuple(sorted(helpers)),
    )


def scan_source(text: str, relpath: str = "python/sglang/module.py") -> tuple[Gate, ...]:
    """The gates of one module's source on its own (no other module's exports)."""
    parsed = parse_module(relpath, text.encode())
    if isinstance(parsed, ScanProblem):
        raise ValueError(parsed.message)
    return assign_occurrences(list(analyse_module(parsed, Context()).gates))


def _context(exports: ExportTable, modules: frozenset[str]) -> Context:
    by_name: dict[str, list[str]] = {}
    for module, name in exports:
        by_name.setdefault(name, []).append(module)
    return Context(exports=exports, modules=modules, by_name=by_name)


def _serial(
    files: list[tuple[str, str]], modules: frozenset[str]
) -> tuple[list[ModuleResult], list[ScanProblem]]:
    share = _Share()
    exports, _ = _pass_one(files, modules, share)
    results, problems = _pass_two(_context(exports, modules), share)
    share.clear()  # break the syntax trees' reference cycles now
    return results, problems


def _worker(connection: Connection) -> None:
    """A worker process: runs the passes on its share until told to stop."""
    gc.disable()  # long-lived syntax trees, no garbage worth collecting
    share = _Share()
    while True:
        message = connection.recv()
        if message is None:
            connection.close()
            os._exit(0)  # nothing to flush; freeing every syntax tree would only cost time
        try:
            if message[0] == "one":
                reply: object = _pass_one(message[1], message[2], share)
            else:
                reply = _pass_two(message[1], share)
        except BaseException:  # a bug: hand the traceback to the parent
            connection.send(("error", traceback.format_exc()))
            continue
        connection.send(("ok", reply))


def _receive(connection: Connection) -> Any:
    status, reply = connection.recv()
    if status != "ok":
        raise RuntimeError(f"gate scan worker failed:\n{reply}")
    return reply


def _parallel(
    shares: list[list[tuple[str, str]]], modules: frozenset[str]
) -> tuple[list[ModuleResult], list[ScanProblem]]:
    forking = "fork" in multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork") if forking else multiprocessing.get_context("spawn")
    # One process per share: the second pass must reach the process that
    # holds the share's files (and syntax trees) from the first.
    connections: list[Connection] = []
    processes = []
    try:
        for _ in shares:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_worker, args=(child,), daemon=True)
            process.start()
            child.close()
            connections.append(parent)
            processes.append(process)
        for connection, share in zip(connections, shares, strict=True):
            connection.send(("one", share, modules))
        exports: ExportTable = {}
        for connection in connections:
            table, _ = _receive(connection)  # problems come back with pass two
            exports.update(table)
        context = _context(exports, modules)
        for connection in connections:
            connection.send(("two", context))
        results: list[ModuleResult] = []
        problems: list[ScanProblem] = []
        for connection in connections:
            found, more = _receive(connection)
            results += found
            problems += more
    finally:
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.send(None)
                connection.close()
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    return results, problems
