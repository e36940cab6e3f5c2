"""The sealed compile cache (consumer/serve/compile_cache.py): one subdirectory per
environment key, a manifest with a checksum per file written after the warm-up; a cache for
another environment is never read, and a corrupt one is set aside and rebuilt, with one
warning line naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import structlog

from consumer.serve.compile_cache import (
    MANIFEST,
    PRUNE_AFTER_S,
    apply,
    environment_key,
    kernels_hash,
    key_name,
    relocated,
    seed,
    write_seed_record,
)

KEY = {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "gpu": "NVIDIA H200"}


def _compile(env: dict[str, str], name: str, body: bytes = b"cubin") -> Path:
    """A kernel as Triton leaves one: a file in a hash-named directory of TRITON_CACHE_DIR."""
    f = Path(env["TRITON_CACHE_DIR"]) / "HASH" / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(body)
    return f


def test_a_sealed_cache_is_read_back_on_the_next_start(tmp_path: Path) -> None:
    """After the seal, a new start (another process, same environment) finds the cache sealed
    and its files where they were: the warm-up loads them."""
    env: dict[str, str] = {}
    first = apply(tmp_path, tmp_path, env, key=KEY)
    assert first.state == "new"
    _compile(env, "k.cubin")
    assert first.seal() == 1
    manifest = json.loads((first.path / MANIFEST).read_text())  # type: ignore[operator]
    assert manifest["key"] == KEY and list(manifest["files"]) == ["triton/HASH/k.cubin"]

    again: dict[str, str] = {}
    second = apply(tmp_path, tmp_path, again, key=KEY)
    assert second.state == "sealed" and again == env
    assert (Path(again["TRITON_CACHE_DIR"]) / "HASH" / "k.cubin").read_bytes() == b"cubin"


def test_another_environment_starts_empty_and_leaves_the_old_one(tmp_path: Path) -> None:
    """A consumer with another Triton (or GPU, torch, kernels...) uses its own empty
    subdirectory: it never reads kernels built for another environment, and leaves them to
    the machines they fit."""
    env: dict[str, str] = {}
    old = apply(tmp_path, tmp_path, env, key=KEY)
    _compile(env, "k.cubin")
    old.seal()
    newer = {**KEY, "triton": "3.7.0"}
    other: dict[str, str] = {}
    fresh = apply(tmp_path, tmp_path, other, key=newer)
    assert fresh.state == "new" and fresh.path != old.path
    assert not any(Path(other["TRITON_CACHE_DIR"]).iterdir())
    assert (old.path / MANIFEST).is_file()  # type: ignore[operator]


def test_a_corrupt_cache_is_set_aside_and_rebuilt_with_one_warning(tmp_path: Path) -> None:
    """A file that no longer matches its checksum makes the cache corrupt: it is moved aside
    (never served from), the start gets an empty directory, and one warning names the path."""
    env: dict[str, str] = {}
    cache = apply(tmp_path, tmp_path, env, key=KEY)
    kernel = _compile(env, "k.cubin")
    cache.seal()
    kernel.write_bytes(b"cubiN")  # same size, other bytes
    with structlog.testing.capture_logs() as logs:
        rebuilt = apply(tmp_path, tmp_path, {}, key=KEY)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["compile_cache.corrupt"]
    assert warnings[0]["path"] == str(cache.path)
    assert "triton/HASH/k.cubin: checksum differs" in warnings[0]["problems"]
    assert rebuilt.state == "rebuilt" and rebuilt.path == cache.path
    assert not (rebuilt.path / MANIFEST).exists()  # type: ignore[operator]
    assert not any(Path(rebuilt.variables["TRITON_CACHE_DIR"]).iterdir())
    [aside] = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert (aside / "triton" / "HASH" / "k.cubin").read_bytes() == b"cubiN"


def test_a_missing_file_or_a_bad_manifest_is_corrupt(tmp_path: Path) -> None:
    """A listed file gone, or a manifest that does not parse: both rebuild."""
    env: dict[str, str] = {}
    cache = apply(tmp_path / "a", tmp_path, env, key=KEY)
    _compile(env, "k.cubin")
    cache.seal()
    (Path(env["TRITON_CACHE_DIR"]) / "HASH" / "k.cubin").unlink()
    assert apply(tmp_path / "a", tmp_path, {}, key=KEY).state == "rebuilt"

    env = {}
    cache = apply(tmp_path / "b", tmp_path, env, key=KEY)
    (cache.path / MANIFEST).write_text("{not json")  # type: ignore[operator]
    assert apply(tmp_path / "b", tmp_path, {}, key=KEY).state == "rebuilt"


def test_seal_rewrites_only_when_files_were_added(tmp_path: Path) -> None:
    """A start that compiled nothing leaves the manifest as it was; one that added a kernel
    lists it."""
    env: dict[str, str] = {}
    apply(tmp_path, tmp_path, env, key=KEY)
    _compile(env, "a.cubin")
    apply(tmp_path, tmp_path, {}, key=KEY).seal()
    cache = apply(tmp_path, tmp_path, {}, key=KEY)
    manifest = cache.path / MANIFEST  # type: ignore[operator]
    before = manifest.stat().st_mtime_ns
    assert cache.seal() == 1 and manifest.stat().st_mtime_ns == before
    _compile(env, "b.cubin")
    assert cache.seal() == 2
    assert "triton/HASH/b.cubin" in json.loads(manifest.read_text())["files"]


def test_other_environments_unused_for_a_month_are_pruned(tmp_path: Path) -> None:
    """Subdirectories of other environments not opened for PRUNE_AFTER_S are removed; recent
    ones stay."""
    old, recent = tmp_path / "old-env", tmp_path / "recent-env"
    old.mkdir()
    recent.mkdir()
    stale = os.stat(old).st_mtime - PRUNE_AFTER_S - 60
    os.utime(old, (stale, stale))
    apply(tmp_path, tmp_path, {}, key=KEY)
    assert not old.exists() and recent.is_dir()


def test_environment_key_names_what_kernels_depend_on(tmp_path: Path) -> None:
    """The key holds torch, Triton, CUDA, the GPU, Python and the kernels' source hash; a change
    to a kernel source changes the hash (and so the subdirectory)."""
    key = environment_key()
    assert {"torch", "triton", "cuda", "gpu", "python", "kernels"} <= set(key)
    repo = tmp_path / "repo"
    (repo / "consumer" / "kernels").mkdir(parents=True)
    (repo / "consumer" / "kernels" / "k.py").write_text("A = 1\n")
    (repo / "consumer" / "head_common.py").write_text("B = 1\n")
    before = kernels_hash(repo)
    (repo / "consumer" / "kernels" / "k.py").write_text("A = 2\n")
    assert kernels_hash(repo) != before
    assert key_name({**KEY, "kernels": before}) != key_name(KEY)


def test_a_seal_records_the_plan_and_the_next_start_finds_it(tmp_path: Path) -> None:
    """A seal after a full warm-up records that start's precompile plan; a new start reading
    the cache holds that plan (its workers need not run) and no other; a corrupt cache holds
    none."""
    env: dict[str, str] = {}
    first = apply(tmp_path, tmp_path, env, key=KEY)
    _compile(env, "k.cubin")
    assert not first.holds("plan-a")  # new: nothing sealed yet
    first.seal("plan-a")
    second = apply(tmp_path, tmp_path, {}, key=KEY)
    assert second.holds("plan-a") and not second.holds("plan-b")
    second.seal("plan-b")  # no new file, a new plan: the manifest is rewritten
    third = apply(tmp_path, tmp_path, {}, key=KEY)
    assert third.holds("plan-a") and third.holds("plan-b")
    (Path(env["TRITON_CACHE_DIR"]) / "HASH" / "k.cubin").write_bytes(b"changed")
    rebuilt = apply(tmp_path, tmp_path, {}, key=KEY)
    assert rebuilt.state == "rebuilt" and not rebuilt.holds("plan-a")


def test_compiled_kernels_counts_tritons_and_quacks(tmp_path: Path) -> None:
    """`compiled_in_warmup` (consumer.warmed_up) counts and names what the warm-up compiled:
    Triton's kernels by their metadata group file (not each file of one), quack-kernels'
    GEMMs by their object file (not their lock files); none where the cache is not ours."""
    from consumer.serve.service import compiled_kernels

    env: dict[str, str] = {}
    cache = apply(tmp_path, tmp_path, env, key=KEY)
    assert compiled_kernels(cache) == set()
    _compile(env, "__grp__k.json")
    _compile(env, "k.cubin")
    quack = Path(env["QUACK_CACHE_DIR"]) / "FINGERPRINT"
    quack.mkdir(parents=True)
    (quack / "sha.o").write_bytes(b"elf")
    (quack / "sha.lock").write_bytes(b"")
    assert compiled_kernels(cache) == {"triton:k@HASH", "quack:sha"}
    assert compiled_kernels(apply(None, tmp_path, dict(env), key=KEY)) == set()


def _seed(folder: Path, key: dict[str, str]) -> dict[str, bytes]:
    """A seed as consumer/serve/bake.py leaves one: kernels under triton/ and quack/, and its
    record. Returns each file's path (relative) and bytes."""
    files = {
        "triton/HASH/k.cubin": b"cubin",
        "triton/HASH/__grp__k.json": b'{"child_paths": {}}',
        "quack/ab/gemm.o": b"object",
    }
    for rel, body in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(body)
    assert write_seed_record(folder, key) == len(files)
    return files


def test_a_seed_fills_a_cache_not_sealed_yet_file_by_checked_file(tmp_path: Path) -> None:
    """A fresh machine's cache takes the seed's kernels (each checked against the seed's
    record); a file the cache has already is left as it is, and a sealed cache takes none."""
    files = _seed(tmp_path / "seed", KEY)
    env: dict[str, str] = {}
    cache = apply(tmp_path / "root", tmp_path, env, key=KEY)
    assert cache.path is not None
    (cache.path / "triton" / "HASH").mkdir()
    (cache.path / "triton/HASH/k.cubin").write_bytes(b"compiled here")
    with structlog.testing.capture_logs() as logs:
        assert seed(cache, tmp_path / "seed") == 2
    assert (cache.path / "triton/HASH/k.cubin").read_bytes() == b"compiled here"
    for rel in ("triton/HASH/__grp__k.json", "quack/ab/gemm.o"):
        assert (cache.path / rel).read_bytes() == files[rel]
    assert [e["event"] for e in logs] == ["compile_cache.seeded"] and logs[0]["files"] == 2
    assert cache.describe()["opened"] == "seeded" and cache.state == "new"
    assert not list(cache.path.rglob(".*.tmp"))  # no temporary left behind
    cache.seal()
    sealed = apply(tmp_path / "root", tmp_path, {}, key=KEY)
    assert sealed.state == "sealed" and seed(sealed, tmp_path / "seed") == 0


def test_a_stale_or_corrupt_seed_is_not_served(tmp_path: Path) -> None:
    """A seed compiled under another Triton (or quack, or kernel source) copies nothing, and
    one warning line names what differs; a seed file whose checksum does not match its
    record is skipped (compiled again) with one warning line; a folder that is no seed at
    all, one warning line naming the setting, and so does a cache whose directories the
    environment set (not teacherq's to fill). The torch or GPU model it was baked beside do
    not matter: Triton's kernels do not depend on them."""
    _seed(tmp_path / "old", {**KEY, "triton": "3.5.0"})
    cache = apply(tmp_path / "root", tmp_path, {}, key={**KEY, "gpu": "NVIDIA H100", "torch": "x"})
    assert cache.path is not None
    with structlog.testing.capture_logs() as logs:
        assert seed(cache, tmp_path / "old") == 0
        assert seed(cache, tmp_path / "nothing-here") == 0
    assert [e["event"] for e in logs] == ["compile_cache.seed_stale", "compile_cache.seed_unusable"]
    assert logs[0]["differs"] == {"triton": ["3.5.0", "3.6.0"]}
    assert "COMPILE_CACHE_SEED" in logs[1]["setting"]
    assert not any(f.is_file() for f in cache.path.rglob("*"))

    _seed(tmp_path / "seed", KEY)
    (tmp_path / "seed/quack/ab/gemm.o").write_bytes(b"objecT")  # same size, other bytes
    with structlog.testing.capture_logs() as logs:
        assert seed(cache, tmp_path / "seed") == 2
    [corrupt] = [e for e in logs if e["event"] == "compile_cache.seed_corrupt"]
    assert corrupt["files"] == ["quack/ab/gemm.o"] and corrupt["log_level"] == "warning"
    assert not (cache.path / "quack/ab/gemm.o").exists()

    external = apply(None, tmp_path, {"TRITON_CACHE_DIR": str(tmp_path / "theirs")}, key=KEY)
    with structlog.testing.capture_logs() as logs:
        assert seed(external, tmp_path / "seed") == 0  # not ours to fill: said once
    assert [e["event"] for e in logs] == ["compile_cache.seed_unused"]
    assert not (tmp_path / "theirs" / "HASH").exists()


def test_seeded_groups_name_the_cache_s_own_files(tmp_path: Path) -> None:
    """Triton finds a kernel through its group file, which names each of the kernel's files by
    absolute path: in the seed, the seed's own. Seeded, the group names the copies beside it
    (the seed may be gone, or elsewhere, when Triton looks); other files are copied as they
    are."""
    folder = tmp_path / "seed"
    kernel = folder / "triton" / "HASH"
    kernel.mkdir(parents=True)
    (kernel / "k.cubin").write_bytes(b"cubin")
    (kernel / "k.json").write_bytes(b"{}")
    children = {name: str(kernel / name) for name in ("k.cubin", "k.json")}
    (kernel / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
    write_seed_record(folder, KEY)
    cache = apply(tmp_path / "root", tmp_path, {}, key=KEY)
    assert cache.path is not None and seed(cache, folder) == 3
    here = cache.path / "triton" / "HASH"
    group = json.loads((here / "__grp__k.json").read_text())
    assert group == {"child_paths": {n: str(here / n) for n in ("k.cubin", "k.json")}}
    assert (here / "k.cubin").read_bytes() == b"cubin"
    assert relocated(here / "__grp__k.json", (here / "__grp__k.json").read_bytes()) is None
    assert relocated(here / "x", b"not a group") is None
