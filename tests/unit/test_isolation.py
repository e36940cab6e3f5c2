"""The suite's own guard rails: deadlines scale with TEACHERQ_TEST_TIMEOUT_SCALE, and a test
that opens a path beside the repository is caught (a user's clone has nothing beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.isolation import GUARD as OUTSIDE_READS
from tests.isolation import REPO
from tests.timing import ENV, scaled, wait_until


def test_a_read_beside_the_repository_is_recorded() -> None:
    """Opening `../shared/...` (which only CI's checkout has) is recorded, even when the
    file does not exist; paths in the checkout and the temp dir are not."""
    beside = REPO.parent / "shared" / "data" / "no-such-file.json"
    with pytest.raises(FileNotFoundError):
        open(beside)  # noqa: SIM115 - the open itself is what is recorded
    (REPO / "pyproject.toml").read_text()
    assert OUTSIDE_READS.take() == [str(beside)]
    assert not OUTSIDE_READS.outside(str(REPO / "tests" / "conftest.py"))
    sibling = os.path.join(str(REPO), "..", "sibling", "x")
    # A sibling checkout is caught unless the checkout itself lies in the temp dir (then the
    # temp dir's other folders are the tests' own); `../shared` is caught either way.
    in_temp = REPO.parent.is_relative_to(Path(tempfile.gettempdir()).resolve())
    assert OUTSIDE_READS.outside(sibling) is not in_temp


def test_deadlines_scale_with_the_environment() -> None:
    """TEACHERQ_TEST_TIMEOUT_SCALE multiplies every deadline; a bad value names the variable."""
    code = "from tests.timing import scaled; print(scaled(10))"
    env = {**os.environ, ENV: "2.5", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "25.0", out.stderr
    env[ENV] = "fast"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and f"{ENV}='fast'" in bad.stderr


def test_wait_until_returns_the_first_truthy_value_and_names_what_timed_out() -> None:
    """wait_until returns as soon as its check holds, and its TimeoutError names the wait."""
    calls = iter([0, None, "ready"])
    assert wait_until(lambda: next(calls), "a value", timeout=scaled(5), interval=0) == "ready"
    with pytest.raises(TimeoutError, match="never: not within"):
        wait_until(lambda: False, "never", timeout=0.05, interval=0.01)
