"""Where things live in the fork's repository (docs/contract.md "Files")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sm120fork.errors import FatalError

MANIFEST_NAME = "sglang.sha256"  # the pristine tree's sha256 manifest, beside sglang.lock

# Either marks a fork checkout: a new fork has its series before its first import.
_MARKERS = ("patches/series", "vendor/sglang.lock")


@dataclass(frozen=True)
class RepoPaths:
    root: Path

    @property
    def vendor_dir(self) -> Path:
        return self.root / "vendor"

    @property
    def upstream_tree(self) -> Path:
        """Pristine upstream, laid out as upstream's git repo (python/sglang/...)."""
        return self.vendor_dir / "sglang"

    @property
    def lock_file(self) -> Path:
        return self.vendor_dir / "sglang.lock"

    @property
    def manifest_file(self) -> Path:
        """The sha256 of every file of the pristine tree (see upstream/manifest.py)."""
        return self.vendor_dir / MANIFEST_NAME

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def series_file(self) -> Path:
        return self.patches_dir / "series"

    @property
    def gates_policy(self) -> Path:
        """The reviewed decision for every architecture gate (`sm120fork gates`)."""
        return self.patches_dir / "gates.toml"

    @property
    def intents_file(self) -> Path:
        """The recipes the rebase re-applies a patch by."""
        return self.patches_dir / "intents.toml"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def rebase_dir(self) -> Path:
        """The rebase's report, work repository and state."""
        return self.build_dir / "rebase"

    @property
    def changelog(self) -> Path:
        return self.root / "CHANGELOG.md"


def require_checkout(root: Path) -> None:
    """Refuse a directory that is not the fork's root, saying where it looked: the
    usual cause is running from another directory, not a missing import."""
    if not any((root / marker).is_file() for marker in _MARKERS):
        raise FatalError(
            f"{root} is not a fork checkout (it has no {' or '.join(_MARKERS)}); run "
            "sm120fork from the fork's root or pass its path with -C DIR"
        )
