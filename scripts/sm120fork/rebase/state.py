"""The rebase's persisted state: everything --continue and --abort need after a crash.

It lives in the fork's git directory, `<git dir>/sm120fork-rebase/state.json`:
that survives `git clean -fdx`, is invisible to `git status`, and its
existence is what "a rebase is in progress" means. Every change is written
to a temporary file and renamed over the old one, so a kill -9 at any point
leaves either the previous or the next state, never half of one. The
directory is created by renaming a fully written temporary directory into
place, so creating it is also the test-and-set that refuses a second rebase.

`<git dir>/sm120fork-rebase.lock` is `flock`ed by every running rebase
command (start, --continue, --abort, --dry-run), so two processes never work
at once; the kernel drops the lock when a process dies.

Tests simulate a crash with `SM120FORK_REBASE_CRASH_AT=<point>`: the process
ends with `os._exit(137)` (as kill -9 would) when it reaches `crash_point(point)`.
The points (flow.py): after-fetch, after-prepare, mid-carry (a patch carried in
the work repository, not yet recorded), after-patch-<n>, resolved (a
resolution committed, not yet recorded), mid-stage, after-stage, mid-swap
(one target swapped), after-swap.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from sm120fork import gitcmd, jsondata
from sm120fork.errors import FatalError
from sm120fork.fsutil import atomic_write
from sm120fork.gates.diff import GateDiff
from sm120fork.upstream.source import UpstreamSource

CRASH_ENV = "SM120FORK_REBASE_CRASH_AT"
FORMAT = 5  # 2: a step keeps its reason; 3: its strategy; 4: renames; 5: verification

Status = Literal[
    "clean", "offset", "merged", "resolved", "upstreamed", "dropped", "conflict", "pending"
]
Phase = Literal["fetch", "prepare", "carry", "conflict", "finalize"]


def crash_point(name: str) -> None:
    """Test hook: die like kill -9 when $SM120FORK_REBASE_CRASH_AT names this point."""
    if os.environ.get(CRASH_ENV) == name:
        os._exit(137)


@dataclass(frozen=True)
class Conflict:
    file: str
    line: int  # in the new upstream file; 0 when the whole file conflicts
    gate: bool
    ours: str  # new upstream (with the patches carried before this one)
    theirs: str  # the patch
    base: str = ""  # the old upstream


@dataclass(frozen=True)
class StepResult:
    version: str
    status: Status
    by_hand: bool = False  # a conflict a person resolved
    reason: str = ""  # why, in the tool's words, without the fate's (fate.step_detail)
    note: str = ""  # the person's word on a hand resolution: why the tool could not
    strategy: str = ""  # what carried or dropped it (carry.STRATEGIES' names, "by hand")
    verified: str = ""  # what its gate-table rows showed on the patched release (verify.py)


@dataclass(frozen=True)
class PatchState:
    name: str
    strip: int
    status: Status = "pending"
    detail: str = ""
    text: str = ""  # normal form against the last release carried to
    commit: str = ""  # the patch's commit in the work repository at that release
    steps: tuple[StepResult, ...] = ()
    conflicts: tuple[Conflict, ...] = ()
    # Functions upstream renamed that its intent follows (old, new), oldest first;
    # landing writes them into patches/intents.toml.
    renames: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Target:
    """A release the series is carried to (several with --step, oldest first)."""

    version: str
    lock_text: str = ""  # its vendor/sglang.lock; empty until fetched
    base_commit: str = ""  # its tree's commit in the work repository; empty until made


@dataclass(frozen=True)
class Journal:
    """Progress of the final swap (see landing.py)."""

    step: Literal["staging", "staged", "swapped"]
    items: tuple[tuple[str, bool], ...]  # (target relative to the root, existed before)


@dataclass(frozen=True)
class RebaseState:
    from_version: str
    git_url: str | None  # stored as given; read it as `source`
    step_mode: bool
    phase: Phase
    targets: tuple[Target, ...]
    patches: tuple[PatchState, ...]
    old_base: str = ""
    release_index: int = 0  # the target being carried to
    patch_index: int = 0  # the next patch to carry to it
    tip: str = ""  # work-repo commit: target tree + patches carried so far; "" before it exists
    journal: Journal | None = None
    fingerprint: str = ""  # what the rebase lands, as committed when it started
    gates: GateDiff | None = None  # the report's gates section, once computed
    # With --step: each release's gate findings against the release before it, once computed.
    release_gates: dict[str, GateDiff] | None = None
    # The patches as the current release's carry found them (verify.py goes back to it).
    release_start: tuple[PatchState, ...] = ()
    format: int = FORMAT

    @property
    def source(self) -> UpstreamSource:
        return UpstreamSource(self.git_url)

    @property
    def target(self) -> Target:
        return self.targets[min(self.release_index, len(self.targets) - 1)]

    @property
    def final(self) -> Target:
        return self.targets[-1]

    def with_patch(self, index: int, patch: PatchState) -> RebaseState:
        patches = list(self.patches)
        patches[index] = patch
        return replace(self, patches=tuple(patches))

    def with_target(self, index: int, target: Target) -> RebaseState:
        targets = list(self.targets)
        targets[index] = target
        return replace(self, targets=tuple(targets))


def dumps(state: RebaseState) -> str:
    data = dataclasses.asdict(replace(state, gates=None, release_gates=None))
    data["gates"] = None if state.gates is None else state.gates.to_json()
    if state.release_gates is not None:
        data["release_gates"] = {v: d.to_json() for v, d in state.release_gates.items()}
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def loads(text: str) -> RebaseState:
    # The records are read by their fields' names; the gates, which the report shows,
    # through their typed reader.
    data: dict[str, Any] = json.loads(text)
    if data.get("format") != FORMAT:
        raise FatalError("the rebase state was written by another version of the tool; --abort")
    journal = data.pop("journal")
    gates, release_gates = data.pop("gates"), data.pop("release_gates")
    return RebaseState(
        **{k: v for k, v in data.items() if k not in ("targets", "patches", "release_start")},
        gates=None if gates is None else GateDiff.from_json(jsondata.obj(gates)),
        release_gates=None
        if release_gates is None
        else {v: GateDiff.from_json(jsondata.obj(d)) for v, d in release_gates.items()},
        targets=tuple(Target(**t) for t in data["targets"]),
        patches=tuple(_patch(p) for p in data["patches"]),
        release_start=tuple(_patch(p) for p in data["release_start"]),
        journal=None
        if journal is None
        else Journal(journal["step"], tuple((t, bool(e)) for t, e in journal["items"])),
    )


def _patch(data: dict[str, Any]) -> PatchState:
    return PatchState(
        **{k: v for k, v in data.items() if k not in ("steps", "conflicts", "renames")},
        steps=tuple(StepResult(**s) for s in data["steps"]),
        conflicts=tuple(Conflict(**c) for c in data["conflicts"]),
        renames=tuple((old, new) for old, new in data["renames"]),
    )


class Store(Protocol):
    def save(self, state: RebaseState) -> None: ...

    def remove(self) -> None: ...


class MemoryStore:
    """For --dry-run: keeps nothing."""

    def save(self, state: RebaseState) -> None:
        del state

    def remove(self) -> None:
        pass


@dataclass(frozen=True)
class StateDir:
    """`<git dir>/sm120fork-rebase/`: the persisted state of a rebase in progress."""

    git_dir: Path

    @classmethod
    def of(cls, root: Path) -> StateDir:
        result = gitcmd.run(
            ["rev-parse", "--absolute-git-dir"], root, check=False, user_config=True
        )
        if result.returncode != 0:
            raise FatalError(f"{root} is not a git repository; rebase needs the fork's checkout")
        return cls(Path(result.stdout.decode().strip()))

    @property
    def path(self) -> Path:
        return self.git_dir / "sm120fork-rebase"

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    def exists(self) -> bool:
        return self.path.exists()

    def create(self, state: RebaseState) -> None:
        """Write the first state; refuse if a rebase is already in progress."""
        staging = Path(tempfile.mkdtemp(prefix=".sm120fork-rebase.", dir=self.git_dir))
        (staging / "state.json").write_text(dumps(state), encoding="utf-8")
        try:
            staging.rename(self.path)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise FatalError(
                "a rebase is already in progress; finish it with --continue or drop it with --abort"
            ) from error

    def load(self) -> RebaseState:
        if not self.exists():
            raise FatalError("no rebase in progress; start one with `rebase VERSION`")
        try:
            text = self.state_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise FatalError(
                f"cannot read the rebase state {self.state_file} ({error}); run `rebase --abort`"
            ) from error
        try:
            return loads(text)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            # Written only by atomic renames: damage came from outside the tool.
            raise FatalError(
                f"the rebase state {self.state_file} is damaged ({type(error).__name__}: "
                f"{error}); run `rebase --abort`"
            ) from error

    def save(self, state: RebaseState) -> None:
        atomic_write(self.state_file, dumps(state).encode("utf-8"))

    def remove(self) -> None:
        # Rename first: a crash while deleting leaves no half state behind.
        if self.path.exists():
            trash = Path(tempfile.mkdtemp(prefix=".sm120fork-rebase-old.", dir=self.git_dir))
            self.path.rename(trash / "state")
            shutil.rmtree(trash)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Hold the lock that keeps a second rebase process out while this one works."""
        with open(self.git_dir / "sm120fork-rebase.lock", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FatalError(
                    "another `sm120fork rebase` is running in this repository; wait for it"
                ) from None
            yield
