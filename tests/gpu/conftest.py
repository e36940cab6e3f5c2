"""Fixtures for the CUDA tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _portable_gumbel_screen():
    """TEACHERQ_TEST_PORTABLE_GUMBEL=1 runs every test with the portable Gumbel screen instead
    of the fast one (to tell a fault of the fast screen from one elsewhere)."""
    if os.environ.get("TEACHERQ_TEST_PORTABLE_GUMBEL") != "1":
        yield
        return
    from consumer.kernels import gumbel

    old = gumbel.CONFIG.fast_screen
    gumbel.CONFIG.fast_screen = False
    try:
        yield
    finally:
        gumbel.CONFIG.fast_screen = old
