"""Inventory a tree: `scan_tree(root) -> Inventory`.

The files are split between worker processes that keep their share of the
files (and their syntax trees) in memory across the passes of `passes`:
exports, gates, the calls between modules, and the modules those reach. Here
the parent merges what each pass found and hands it to the next. A file that
cannot be parsed or analysed becomes a `ScanProblem`, never a crash.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import traceback
from collections.abc import Callable, Iterable
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sm120fork.errors import FatalError
from sm120fork.gates import passes, scancache
from sm120fork.gates.analyze import ModuleResult, analyse_module, parse_module
from sm120fork.gates.evaluator import Context
from sm120fork.gates.model import Gate, Inventory, ScanProblem, assign_occurrences
from sm120fork.gates.passes import Calls, Files, Share
from sm120fork.gates.scopes import module_name
from sm120fork.gates.values import ClassFacts, ClassRef, ExportTable

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


def _split(files: list[tuple[str, str, int]], parts: int) -> list[Files]:
    """Deal files out by size so each share holds about as many bytes."""
    shares: list[Files] = [[] for _ in range(parts)]
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
    `list_files` gives them, scans those instead (a tree with some files swapped).
    A tree whose files were scanned before is answered from `scancache`."""
    files = list_files(package_dir(root)) if files is None else files
    try:
        key: str | None = scancache.tree_key(files)
    except OSError:  # an unreadable file: the scan reports it, nothing is kept
        key = None
    cached = scancache.load(key) if key else None
    if cached is not None:
        return replace(cached, root=str(root))
    inventory = _scan_files(root, files, workers)
    if key:
        scancache.store(key, inventory)
    return inventory


def _scan_files(root: Path, files: list[tuple[str, str, int]], workers: int | None) -> Inventory:
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


def _context(exports: ExportTable, modules: frozenset[str], **flows: Any) -> Context:
    by_name: dict[str, list[str]] = {}
    for module, name in exports:
        by_name.setdefault(name, []).append(module)
    return Context(exports=exports, modules=modules, by_name=by_name, **flows)


# A pass by name: (its argument, the share) -> its reply.
PASSES: dict[str, Callable[[Any, Share], Any]] = {
    "exports": lambda argument, share: passes.exports(argument[0], argument[1], share),
    "gates": passes.gates,
    "calls": passes.calls,
    "again": passes.again,
}
# Runs one pass on every share: the pass's name, one argument per share -> the replies.
Run = Callable[[str, list[Any]], list[Any]]


def _scan(
    run: Run, shares: list[Files], modules: frozenset[str]
) -> tuple[list[ModuleResult], list[ScanProblem]]:
    """The passes in order, each with what the one before found in every share."""
    each = len(shares)
    exports: ExportTable = {}
    for table, _ in run("exports", [(files, modules) for files in shares]):
        exports.update(table)  # problems come back with pass two
    results: dict[str, ModuleResult] = {}
    problems: list[ScanProblem] = []
    _collect(run("gates", [_context(exports, modules)] * each), results, problems)
    seen: Calls = {}  # the calls pass two saw: those with an architecture argument
    classes: dict[ClassRef, ClassFacts] = {}
    for result in results.values():
        for target, records in result.calls_out.items():
            seen.setdefault(target, []).extend(records)
        classes.update(result.classes)
    if not seen and not any(facts.attrs for facts in classes.values()):
        return list(results.values()), problems
    flowing = _context(exports, modules, calls=seen, classes=classes)
    changed: dict[str, ModuleResult] = {}
    for found, more in run("again", [(flowing, None)] * each):
        changed.update((r.relpath, r) for r in found if _differs(r, results.get(r.relpath)))
        problems += more
    before = dict(results)
    results.update(changed)
    # A parameter is architectural only if every call says so: find them all
    # for the functions (and classes) whose gates the calls seen so far changed.
    reached = {(r.module, fn) for r in changed.values() for fn in _changed_functions(r, before)}
    targets = frozenset(
        (module, name)
        for module, name in seen
        if any(m == module and (fn == name or fn.startswith(name + ".")) for m, fn in reached)
    )
    if targets:
        calls: Calls = {}
        for found in run("calls", [targets] * each):
            for target, records in found.items():
                calls.setdefault(target, []).extend(records)
        complete = _context(exports, modules, calls={**seen, **calls}, classes=classes)
        only = frozenset(t[0] for t in targets)
        _collect(run("again", [(complete, only)] * each), results, problems)
    return list(results.values()), problems


def _differs(result: ModuleResult, before: ModuleResult | None) -> bool:
    return before is None or result.gates != before.gates


def _changed_functions(result: ModuleResult, before: dict[str, ModuleResult]) -> set[str]:
    """Functions of `result` with a gate that is new or evaluates differently."""
    old = before.get(result.relpath)
    known = {(g.function, g.condition, tuple(g.archs.items())) for g in old.gates} if old else set()
    return {
        g.function
        for g in result.gates
        if (g.function, g.condition, tuple(g.archs.items())) not in known
    }


def _collect(
    replies: Iterable[tuple[list[ModuleResult], list[ScanProblem]]],
    results: dict[str, ModuleResult],
    problems: list[ScanProblem],
) -> None:
    for found, more in replies:
        results.update((result.relpath, result) for result in found)  # a later pass wins
        problems += more


def _serial(files: Files, modules: frozenset[str]) -> tuple[list[ModuleResult], list[ScanProblem]]:
    share = Share()

    def run(name: str, arguments: list[Any]) -> list[Any]:
        return [PASSES[name](arguments[0], share)]

    try:
        return _scan(run, [files], modules)
    finally:
        share.clear()  # break the syntax trees' reference cycles now


def _worker(connection: Connection) -> None:
    """A worker process: runs the passes on its share until told to stop."""
    gc.disable()  # long-lived syntax trees, no garbage worth collecting
    share = Share()
    while True:
        message = connection.recv()
        if message is None:
            connection.close()
            os._exit(0)  # nothing to flush; freeing every syntax tree would only cost time
        try:
            reply = PASSES[message[0]](message[1], share)
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
    shares: list[Files], modules: frozenset[str]
) -> tuple[list[ModuleResult], list[ScanProblem]]:
    forking = "fork" in multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork") if forking else multiprocessing.get_context("spawn")
    # One process per share: a later pass must reach the process that holds
    # the share's files (and syntax trees) from the first.
    connections: list[Connection] = []
    processes = []

    def run(name: str, arguments: list[Any]) -> list[Any]:
        for connection, argument in zip(connections, arguments, strict=True):
            connection.send((name, argument))
        return [_receive(connection) for connection in connections]

    try:
        for _ in shares:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_worker, args=(child,), daemon=True)
            process.start()
            child.close()
            connections.append(parent)
            processes.append(process)
        return _scan(run, shares, modules)
    finally:
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.send(None)
                connection.close()
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
