"""Where compiled kernels persist across restarts: Triton's and torch inductor's caches.

A fresh consumer compiles every Triton kernel variant its warm-up reaches (seconds each on a
cold machine); kept on disk, a restarted consumer loads them instead. The directories must be
in the environment before Triton or torch compiles anything, so `main()` calls `apply` before
it imports torch. This module imports neither.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path

# environment variable -> subdirectory of the compile cache
CACHE_VARIABLES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def cache_environment(
    setting: Path | None, home: Path, environ: MutableMapping[str, str]
) -> dict[str, str]:
    """The cache variables to set: under `setting` (TEACHERQ_CONSUMER__COMPILE_CACHE_DIR) when
    given, overriding the environment; else under `<home>/compile-cache` for each variable the
    environment does not set already."""
    root = Path(setting) if setting is not None else Path(home) / "compile-cache"
    return {
        var: str(root / sub)
        for var, sub in CACHE_VARIABLES.items()
        if setting is not None or not environ.get(var)
    }


def apply(setting: Path | None, home: Path, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Create the cache directories and put them in `environ` (see `cache_environment`);
    returns every cache variable's value now in effect."""
    for var, path in cache_environment(setting, home, environ).items():
        Path(path).mkdir(parents=True, exist_ok=True)
        environ[var] = path
    return {var: environ[var] for var in CACHE_VARIABLES if environ.get(var)}
