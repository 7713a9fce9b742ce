"""The one exception root for user-facing failures.

Anything raised as `FatalError` is a problem with the input or the
environment, not a bug: the CLI prints its message on one line and exits
with its code. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

# Exit codes shared by every command (see docs/contract.md "Commands").
EXIT_OK = 0
EXIT_FINDINGS = 1  # check found problems, rebase stopped on a conflict, gates unreviewed
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a command killed by SIGINT


class FatalError(Exception):
    """A user error: one line saying what is wrong and what to do."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def message(self) -> str:
        # Keep it on one line whatever the caller passed in.
        return " ".join(str(self.args[0]).split())
