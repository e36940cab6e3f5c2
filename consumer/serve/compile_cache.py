"""Where compiled kernels persist across restarts and machines: a sealed, versioned directory.

A fresh consumer compiles every Triton kernel variant its warm-up reaches (seconds each on a
cold machine); kept on disk, a restarted consumer, or a new one on another machine that
mounts the same volume, loads them instead. The directories must be in the environment
before Triton or torch compiles anything, so `main()` calls `apply` before it imports torch.
This module imports neither.

Layout under the root (`consumer.compile_cache_dir`, else `<redis.home>/compile-cache`):

    <root>/<key>/triton/        TRITON_CACHE_DIR
    <root>/<key>/inductor/      TORCHINDUCTOR_CACHE_DIR
    <root>/<key>/quack/         QUACK_CACHE_DIR (quack-kernels, where installed)
    <root>/<key>/manifest.json  the environment key and a sha256 per file, written after
                                the warm-up (`CompileCache.seal`)

`<key>` names the environment the kernels were compiled for (`environment_key`: torch,
Triton, CUDA, the GPU model, Python, quack-kernels and the CuTe DSL if installed, and a hash
of the kernels' sources). A consumer in another environment uses another subdirectory
(starting empty) and leaves the others for the machines they fit; subdirectories unused for
`PRUNE_AFTER_S` are removed. A subdirectory whose manifest does not match its files (a file
changed, truncated or missing, or a manifest that does not parse) is corrupt: it is moved
aside (`<key>.corrupt-<time>`), one warning line names it, and the consumer starts on an
empty one, which it seals after its warm-up.
Files written after the seal (by another rank or consumer) are not in the manifest; Triton
and quack write each file atomically, and the next seal lists them.

A seed (`consumer.compile_cache_seed`: kernels compiled where the image was built, without a
GPU, by consumer/serve/bake.py) fills a subdirectory that is not sealed yet (`seed`): each of
its files that the subdirectory lacks is copied in after its checksum is checked. A seed
compiled for another Triton, quack-kernels, CuTe DSL or kernel source is not used (one
warning line says which).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import structlog

log = structlog.get_logger("teacherq.consumer")

# environment variable -> subdirectory of the compile cache
# (QUACK_CACHE_DIR: quack-kernels' compiled GEMMs, where that optional package serves the
# experts' GEMMs, consumer/forward/quack_gemm.py)
CACHE_VARIABLES = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "QUACK_CACHE_DIR": "quack",
}
MANIFEST = "manifest.json"
SEED = "seed.json"  # a seed's record: what compiled it, and a checksum per file
# What a seed's kernels depend on (`seed_key`): Triton's compiled kernels on Triton's release
# (its bundled ptxas) and the GPU's architecture (sm90, the bake's target), not on the GPU
# model, torch or the CUDA build, which the rest of `environment_key` names
SEED_KEY = ("format", "triton", "kernels", "quack", "cutlass_dsl")
FORMAT = 1  # of the manifest and the layout; part of the key
PRUNE_AFTER_S = 30 * 86400  # other environments' subdirectories, unused this long
KERNEL_SOURCES = ("consumer/kernels", "consumer/head_common.py")  # what the kernels compile
REPO = Path(__file__).resolve().parents[2]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def _cuda_version() -> str:
    """torch's CUDA version, read from torch/version.py (importing torch takes seconds;
    find_spec locates the package without importing it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        found = re.search(r"^cuda\b.*?=\s*['\"]?([\w.]+)", version.read_text(), re.M)
    except OSError:
        return "none"
    return found.group(1) if found else "none"


def gpu_models() -> str:
    """The NVIDIA GPU models of this host (from the driver's /proc files, else nvidia-smi),
    sorted and joined; "none" without one."""
    models = set()
    for info in Path("/proc/driver/nvidia/gpus").glob("*/information"):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                models.add(line.split(":", 1)[1].strip())
    if not models and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        models = {line.strip() for line in out.splitlines() if line.strip()}
    return ",".join(sorted(models)) or "none"


def kernels_hash(repo: Path = REPO) -> str:
    """sha256 over the kernels' sources (what they compile from), first 16 hex digits."""
    digest = hashlib.sha256()
    for rel in KERNEL_SOURCES:
        path = repo / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(f.relative_to(repo).as_posix().encode() + b"\0")
            digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def environment_key() -> dict[str, str]:
    """What a compiled kernel depends on beyond its source: a cache built for another key is
    stale here."""
    return {
        "format": str(FORMAT),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "cuda": _cuda_version(),
        "gpu": gpu_models(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "kernels": kernels_hash(),
        "quack": _version("quack-kernels"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
    }


def key_name(key: dict[str, str]) -> str:
    """The subdirectory name of `key`: readable prefix, hash of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    triton = re.sub(r"[^\w.]", "_", key.get("triton", "none"))
    return f"triton{triton}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"


def _files(path: Path) -> Iterator[Path]:
    for sub in CACHE_VARIABLES.values():
        base = path / sub
        if base.is_dir():
            yield from (f for f in sorted(base.rglob("*")) if f.is_file() and not f.is_symlink())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def problems(path: Path, key: dict[str, str]) -> list[str]:
    """Why the cache at `path` cannot be trusted (empty: it can, or it was never sealed)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return []
    try:
        sealed = json.loads(manifest.read_text())
        recorded = dict(sealed["files"])
        sealed_key = dict(sealed["key"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{MANIFEST} unreadable: {type(exc).__name__}"]
    if sealed_key != key:
        return [f"{MANIFEST} was written for another environment"]
    found = []
    for rel, entry in recorded.items():
        f = path / rel
        if not f.is_file():
            found.append(f"{rel}: missing")
        elif _verified(f, entry) is None:
            found.append(f"{rel}: checksum differs")
    return found


def _entry(path: Path) -> dict[str, object]:
    """A manifest's record of one file: its size and sha256."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _verified(path: Path, entry: dict) -> bytes | None:
    """The bytes of the file at `path` where they have the size and sha256 a manifest `entry`
    records, else None (read once: a copy writes the bytes it checked)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) != entry.get("size") or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        return None
    return data


@dataclass
class CompileCache:
    """The cache directories of this process: `variables` (name -> directory) as set in the
    environment; `path` the sealed subdirectory (None where TRITON_CACHE_DIR and
    TORCHINDUCTOR_CACHE_DIR came from the environment: not ours to seal)."""

    variables: dict[str, str]
    path: Path | None = None
    key: dict[str, str] = field(default_factory=dict)
    state: str = "external"  # new, sealed (files checked), rebuilt (was corrupt), external
    sealed_files: frozenset[str] = frozenset()  # what the manifest lists
    # Digests of the precompile plans (consumer/serve/precompile.py's Job.digest) whose warm-up
    # ran to the end before a seal: every kernel such a start needs is in the sealed files.
    plans: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.opened = self.state  # what this start found, for the log and the bench

    def describe(self) -> dict[str, object]:
        """Fields for the start-up log lines."""
        return {"path": str(self.path or ""), "opened": self.opened, "state": self.state}

    def holds(self, plan: str) -> bool:
        """Whether a start with precompile plan `plan` finds every kernel it needs here."""
        return self.state == "sealed" and plan in self.plans

    def seal(self, plan: str | None = None) -> int:
        """Write the manifest after a warm-up that ran to the end: every file now in the cache
        with its checksum, and `plan` (that start's precompile plan digest) among the plans
        the cache holds (atomically: another process reads the old manifest or the new one).
        Returns the file count."""
        if self.path is None:
            return 0
        files = {f.relative_to(self.path).as_posix(): f for f in _files(self.path)}
        plans = self.plans | ({plan} if plan else set())
        if self.state == "sealed" and set(files) == self.sealed_files and plans == self.plans:
            return len(files)  # nothing new since the seal this start checked
        entries = {rel: _entry(f) for rel, f in files.items()}
        body = {"key": self.key, "sealed_at": time.time(), "files": entries, "plans": sorted(plans)}
        _write_atomically(self.path / MANIFEST, json.dumps(body, indent=1, sort_keys=True).encode())
        self.state, self.sealed_files, self.plans = "sealed", frozenset(entries), frozenset(plans)
        return len(entries)


def _prune(root: Path, keep: Path, now: float) -> None:
    """Remove other environments' subdirectories (and corrupt ones set aside) unused for
    PRUNE_AFTER_S; a concurrent prune by another consumer is harmless."""
    for entry in root.iterdir():
        if entry == keep or not entry.is_dir():
            continue
        try:
            if now - entry.stat().st_mtime > PRUNE_AFTER_S:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:
            continue


def open_cache(root: Path, key: dict[str, str]) -> CompileCache:
    """The subdirectory of `root` for `key`, created, checked against its manifest (a corrupt
    one set aside and replaced by an empty one), with the variables pointing into it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / key_name(key)
    state, listed, plans = "new", frozenset[str](), frozenset[str]()
    if (path / MANIFEST).is_file():
        found = problems(path, key)
        state = "sealed"
        if not found:
            manifest = json.loads((path / MANIFEST).read_text())
            listed = frozenset(manifest["files"])
            plans = frozenset(manifest.get("plans", ()))
        if found:
            aside = root / f"{path.name}.corrupt-{int(time.time())}-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):  # another consumer set it aside first
                path.rename(aside)
            log.warning(
                "compile_cache.corrupt",
                path=str(path),
                moved_to=str(aside),
                problems=found[:5],
                note="rebuilt: compiled again on this start",
            )
            state = "rebuilt"
    for sub in CACHE_VARIABLES.values():
        (path / sub).mkdir(parents=True, exist_ok=True)
    os.utime(path)  # in use: not pruned by another machine's consumer
    _prune(root, path, time.time())
    variables = {var: str(path / sub) for var, sub in CACHE_VARIABLES.items()}
    return CompileCache(variables, path, key, state, listed, plans)


GROUP = "__grp__"  # Triton's group files: a kernel's files, each by its absolute path


def relocated(at: Path, data: bytes) -> bytes | None:
    """Triton's group file `data`, to be found at `at`, with each of the kernel's files named
    by its path beside it: Triton records absolute paths, and looks for them there, so a
    cache moved to another directory (pulled, seeded, copied) would miss every kernel. None
    where every path is beside it already, or `data` is no group Triton wrote."""
    try:
        children = json.loads(data)["child_paths"]
        here = {name: str(at.parent / Path(p).name) for name, p in children.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if here == children:
        return None
    return json.dumps({"child_paths": here}).encode()


def relocate_groups(folder: Path, final: Path) -> dict[str, dict[str, object]]:
    """Rewrite the group files of the cache in `folder`, to be moved to `final`, so that they
    name their kernels' files under `final` (`relocated`). Returns the manifest entries of
    the files rewritten."""
    changed: dict[str, dict[str, object]] = {}
    for group in sorted((folder / CACHE_VARIABLES["TRITON_CACHE_DIR"]).glob(f"*/{GROUP}*")):
        rel = group.relative_to(folder)
        new = relocated(final / rel, group.read_bytes())
        if new is not None:
            _write_atomically(group, new)
            changed[rel.as_posix()] = _entry(group)
    return changed


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def seed_key(key: dict[str, str]) -> dict[str, str]:
    """The part of environment key `key` a seed must have been compiled under."""
    return {name: key.get(name, "none") for name in SEED_KEY}


def write_seed_record(folder: Path, key: dict[str, str], **extra: object) -> int:
    """Record the seed at `folder` (its `triton/` and `quack/` as compiled under environment
    key `key`): `seed_key(key)` and a checksum per file, in SEED. Returns the file count."""
    entries = {f.relative_to(folder).as_posix(): _entry(f) for f in _files(folder)}
    body = {"key": seed_key(key), "files": entries, **extra}
    (folder / SEED).write_text(json.dumps(body, indent=1, sort_keys=True))
    return len(entries)


def seed(cache: CompileCache, source: Path) -> int:
    """Copy the seed at `source` into `cache` where it is not sealed (a fresh machine's first
    start, or a rebuilt one): every file the cache lacks whose checksum matches the seed's
    record, each under a temporary name first, Triton's group files (`__grp__*`, which name
    a kernel's other files) after the others and naming the copies (`relocated`). Returns
    the files copied; a seed that is missing, unreadable or compiled for another environment
    copies nothing, with one warning line."""
    if cache.path is None:  # TRITON_CACHE_DIR and the others came from the environment
        reason = (
            "TRITON_CACHE_DIR (or another cache variable) is set in the environment: a seed "
            "fills only a cache that TEACHERQ_CONSUMER__COMPILE_CACHE_DIR opens"
        )
        log.warning("compile_cache.seed_unused", seed=str(source), reason=reason)
        return 0
    if cache.state == "sealed":
        return 0
    try:
        record = json.loads((source / SEED).read_text())
        files, their_key = dict(record["files"]), dict(record["key"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("compile_cache.seed_unusable", seed=str(source),
                    error=f"{type(exc).__name__}: {exc}",
                    setting="TEACHERQ_CONSUMER__COMPILE_CACHE_SEED")  # fmt: skip
        return 0
    ours = seed_key(cache.key)
    if their_key != ours:
        differ = {k: [their_key.get(k), ours[k]] for k in ours if their_key.get(k) != ours[k]}
        log.warning("compile_cache.seed_stale", seed=str(source), differs=differ,
                    note="compiled for another environment: not used")  # fmt: skip
        return 0
    copied, bad = 0, []
    for rel in sorted(files, key=lambda r: (Path(r).name.startswith(GROUP), r)):
        src, dst = source / rel, cache.path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or dst.exists():
            continue
        data = _verified(src, files[rel])
        if data is None:
            bad.append(rel)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(dst, relocated(dst, data) or data)
        copied += 1
    if bad:
        log.warning("compile_cache.seed_corrupt", seed=str(source), files=bad[:5],
                    skipped=len(bad), note="compiled again on this start")  # fmt: skip
    log.info("compile_cache.seeded", seed=str(source), files=copied)
    if copied:
        cache.opened = "seeded"  # what the start-up lines report (`describe`)
    return copied


def apply(
    setting: Path | None,
    home: Path,
    environ: MutableMapping[str, str],
    key: dict[str, str] | None = None,
) -> CompileCache:
    """Open the cache and put its directories in `environ`. The root is `setting`
    (TEACHERQ_CONSUMER__COMPILE_CACHE_DIR) when given, overriding the environment; else
    `<home>/compile-cache`, unless TRITON_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR is set already
    (then those are left as they are, and nothing is sealed). `key`: the environment key
    (default: this environment's)."""
    if setting is None and any(environ.get(var) for var in CACHE_VARIABLES):
        for var in CACHE_VARIABLES:
            if environ.get(var):
                Path(environ[var]).mkdir(parents=True, exist_ok=True)
        present = {var: environ[var] for var in CACHE_VARIABLES if environ.get(var)}
        return CompileCache(present)
    root = Path(setting) if setting is not None else Path(home) / "compile-cache"
    cache = open_cache(root, key if key is not None else environment_key())
    environ.update(cache.variables)
    return cache
