"""Reading the libraries ahead of the import (consumer/serve/readahead.py): it finds the big
shared objects of the installed packages without importing them, and advises every byte."""

from __future__ import annotations

import compileall
import sys
from pathlib import Path

import pytest

from consumer.serve import readahead


def test_finds_torchs_libraries_largest_first() -> None:
    """torch's own shared objects are found (from its install directory), largest first."""
    files = readahead.library_files()
    assert any(f.name.startswith("libtorch") for f in files)
    sizes = [f.stat().st_size for f in files]
    assert sizes == sorted(sizes, reverse=True)


def test_advises_every_byte_and_skips_what_cannot_be_opened(tmp_path: Path) -> None:
    """The bytes advised are the files' sizes; a file gone in the meantime is skipped."""
    a, b = tmp_path / "liba.so", tmp_path / "libb.so.1"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"y" * 24)
    assert readahead.advise([a, b, tmp_path / "gone.so"]) == 1024


def test_start_runs_on_a_daemon_thread() -> None:
    """`start` returns at once; its thread is a daemon (never holds the exit) and finishes."""
    thread = readahead.start()
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_packages_without_bytecode_that_will_get_none_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package with no bytecode for its `__init__` is named when none will be written
    (PYTHONDONTWRITEBYTECODE); once its bytecode exists, or can be written, it is not."""
    import py_compile

    pkg = tmp_path / "tqpkg_nobytecode"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert readahead.without_bytecode(["tqpkg_nobytecode"], dont_write=True) == ["tqpkg_nobytecode"]
    assert readahead.without_bytecode(["tqpkg_nobytecode"], dont_write=False) == []
    py_compile.compile(str(pkg / "__init__.py"))
    assert readahead.without_bytecode(["tqpkg_nobytecode"], dont_write=True) == []
    assert readahead.without_bytecode(["no_such_package_here"], dont_write=True) == []


def test_start_files_list_bytecode_then_the_compile_cache_then_libraries(tmp_path, monkeypatch):
    """What the checkpoint prefetch reads first: a package's bytecode for this interpreter
    (found without importing it), every file of the compile cache, then the libraries."""
    pkg = tmp_path / "site" / "tqfakepkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "sub" / "__init__.py").write_text("Y = 2\n")
    assert compileall.compile_dir(str(pkg), quiet=1)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = readahead.bytecode_files(["tqfakepkg", "no_such_package_here"])
    tag = sys.implementation.cache_tag
    assert sorted(p.relative_to(pkg).as_posix() for p in found) == [
        f"__pycache__/__init__.{tag}.pyc",
        f"sub/__pycache__/__init__.{tag}.pyc",
    ]
    assert "tqfakepkg" not in sys.modules  # found, not imported
    cache = tmp_path / "cache"
    (cache / "triton" / "ab").mkdir(parents=True)
    (cache / "triton" / "ab" / "kernel.cubin").write_bytes(b"x")
    files = readahead.start_files(cache)
    kernel = files.index(cache / "triton" / "ab" / "kernel.cubin")
    libraries = readahead.library_files()
    assert files[kernel + 1 :] == libraries
    assert all(p.suffix == ".pyc" for p in files[:kernel])
    assert readahead.start_files(None) == [*readahead.bytecode_files(), *libraries]
