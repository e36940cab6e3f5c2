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
    """Paths opened beside the checkout (outside it, the temp dir and the interpreter's
    folders), since the last `take()`."""

    def __init__(self, repo: Path) -> None:
        self.repo = str(repo.resolve())
        beside = repo.resolve().parent
        # Never to be read, wherever the checkout lies (a clone in the temp dir included): the
        # shared folder CI lays beside the checkout, and the user's own teacherq state.
        self.forbidden = (
            str(beside / "shared"),
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
            str(Path(tempfile.gettempdir()).resolve()),
            *sorted(os.path.abspath(p) for p in interpreter if p),
        )
        # Anything else beside the checkout (sibling checkouts, data folders).
        self.watched = str(beside)
        self.seen: list[str] = []

    def outside(self, path: str) -> bool:
        """True for a path the tests must not open (absolute, or relative to the cwd)."""
        full = os.path.abspath(path)

        def under(root: str) -> bool:
            return full == root or full.startswith(root.rstrip(os.sep) + os.sep)

        if under(self.repo):
            return False
        if any(under(f) for f in self.forbidden):
            return True
        if any(under(a) for a in self.allowed):
            return False
        return under(self.watched)

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
