"""A guard that a test reads nothing beside the repository: a user's clone has no `../shared`
or sibling checkouts, and a test must not touch the user's own teacherq state either.

An audit hook (Python's `open` audit event: `open()`, `Path.read_text`, `os.open` ...) records
every path a test process opens under the checkout's parent folder but outside the checkout,
and under the user's teacherq state directory; the temp dir is always allowed. The autouse
fixture in tests/conftest.py fails the test that opened one. Child processes are not watched.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
from pathlib import Path


class OutsideReads:
    """Paths opened outside the checkout and the temp dir, since the last `take()`."""

    def __init__(self, repo: Path) -> None:
        self.repo = str(repo.resolve())
        self.watched = (
            str(repo.resolve().parent),
            str(Path.home() / ".local" / "state" / "teacherq"),
        )
        # The temp dir, and the interpreter's own folders (a virtualenv may sit beside the
        # checkout: its lazy imports are not the tests reading outside).
        interpreter = {
            sys.prefix,
            sys.base_prefix,
            sys.exec_prefix,
            *sysconfig.get_paths().values(),
        }
        self.allowed = (
            self.repo,
            str(Path(tempfile.gettempdir()).resolve()),
            *sorted(os.path.abspath(p) for p in interpreter if p),
        )
        self.seen: list[str] = []

    def outside(self, path: str) -> bool:
        """True for a path the tests must not open (absolute, or relative to the cwd)."""
        full = os.path.abspath(path)
        if any(full == a or full.startswith(a + os.sep) for a in self.allowed):
            return False
        return any(full == w or full.startswith(w + os.sep) for w in self.watched)

    def hook(self, event: str, args: tuple) -> None:
        """The audit hook: cheap for every event but `open`."""
        if event != "open":
            return
        path = args[0]
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        elif isinstance(path, os.PathLike):
            path = os.fspath(path)
        if isinstance(path, str) and self.outside(path):
            self.seen.append(os.path.abspath(path))

    def take(self) -> list[str]:
        """The paths recorded since the last call, and forget them."""
        seen, self.seen = self.seen, []
        return seen


REPO = Path(__file__).resolve().parents[1]
GUARD = OutsideReads(REPO)
_installed = False


def install() -> OutsideReads:
    """Install GUARD's hook in this process, once (an audit hook cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(GUARD.hook)
        _installed = True
    return GUARD
