"""The compile cache in object storage: a sealed cache for every machine, without a shared volume.

With `consumer.compile_cache_url` set (an `s3://bucket/prefix` or `file://` location, reached
with the `storage.*` endpoint and keys), each environment's sealed cache (compile_cache.py)
is also kept there as one tar archive named after its environment key:

- `pull`, at start, before anything compiles (by the host's first rank, LOCAL_RANK 0, as
  the seal is): where the local cache is not sealed (a fresh machine), the archive for this
  environment is fetched and unpacked beside it, checked
  against its own manifest (every file's size and sha256, the environment key), and only then
  moved into place. An archive that fails the check is not served from: one warning line, and
  the consumer compiles as on an empty cache.
- `push`, after the seal that follows the warm-up: where the seal added files or plans, the
  cache is archived and stored, in a background thread (the consumer is ready meanwhile; an
  object appears whole or not at all, so a reader never sees half an archive). Consumers
  that push the same key at once each store a complete, sealed archive; the last one stays.

Store failures never stop a consumer: a failed pull starts it on the local cache, a failed
push leaves the archive as it was; each says so in one warning line. This module imports
neither torch nor Triton.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import threading
from pathlib import Path

import structlog

from consumer.serve.compile_cache import (
    MANIFEST,
    CompileCache,
    open_cache,
    problems,
    relocate_groups,
)
from shared.settings import Settings
from shared.storage import ObjectNotFound, ObjectStore, StorageError

log = structlog.get_logger("teacherq.consumer")


def remote(settings: Settings) -> ObjectStore | None:
    """The store `consumer.compile_cache_url` names (None when unset, or, with one warning
    line naming the setting, when it cannot be opened: the local cache serves alone)."""
    url = settings.consumer.compile_cache_url
    if not url:
        return None
    try:
        return ObjectStore.from_settings(settings.storage, url=url)
    except StorageError as exc:
        log.warning("compile_cache.url_unusable", setting="consumer.compile_cache_url",
                    url=url, error=str(exc))  # fmt: skip
        return None


def archive_name(cache: CompileCache) -> str:
    """The object key of `cache`'s archive: its environment key's directory name."""
    assert cache.path is not None
    return f"{cache.path.name}.tar"


def pull(cache: CompileCache, store: ObjectStore) -> CompileCache:
    """`cache` filled from the store's archive for its environment when it is not sealed yet
    and the archive passes its manifest's check (the cache reopened: sealed, with the
    archive's plans); else `cache` as it was."""
    if cache.path is None or cache.state == "sealed":
        return cache
    name = archive_name(cache)
    try:
        data = store.get(name)
    except ObjectNotFound:
        return cache
    except StorageError as exc:
        log.warning("compile_cache.pull_failed", url=store.url_for(name), error=str(exc))
        return cache
    staging = cache.path.with_name(f"{cache.path.name}.incoming-{os.getpid()}")
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(staging, filter="data")  # no absolute paths, links or escapes
        found = problems(staging, cache.key)
        if not (staging / MANIFEST).is_file():
            found = [f"no {MANIFEST}"]
    except (tarfile.TarError, OSError) as exc:
        found = [f"unreadable archive: {type(exc).__name__}: {exc}"]
    if found:
        shutil.rmtree(staging, ignore_errors=True)
        log.warning(
            "compile_cache.pull_refused",
            url=store.url_for(name),
            problems=found[:5],
            note="not served from: compiled on this start and pushed again after the seal",
        )
        return cache
    # Triton's group files name the storing machine's paths: point them here, and the
    # manifest at what they now hold, before anything can see them
    changed = relocate_groups(staging, cache.path)
    if changed:
        manifest = json.loads((staging / MANIFEST).read_text())
        manifest["files"].update(changed)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    shutil.rmtree(cache.path, ignore_errors=True)  # new or rebuilt: nothing sealed in it
    staging.rename(cache.path)
    pulled = open_cache(cache.path.parent, cache.key)
    pulled.opened = "pulled"
    log.info("compile_cache.pulled", url=store.url_for(name), files=len(pulled.sealed_files))
    return pulled


def push(cache: CompileCache, store: ObjectStore, *, wait: bool = False) -> threading.Thread:
    """Store `cache`'s sealed directory as its archive, in a daemon thread (returned;
    `wait`: joined before returning). Call after a seal that changed something."""
    thread = threading.Thread(target=_push, args=(cache, store), name="cache-push", daemon=True)
    thread.start()
    if wait:
        thread.join()
    return thread


def _push(cache: CompileCache, store: ObjectStore) -> None:
    assert cache.path is not None
    name = archive_name(cache)
    try:
        store.put_with_retry(name, _archive(cache.path, sorted(cache.sealed_files)))
    except (StorageError, OSError) as exc:
        log.warning("compile_cache.push_failed", url=store.url_for(name), error=str(exc))
        return
    log.info("compile_cache.pushed", url=store.url_for(name), files=len(cache.sealed_files))


def _archive(path: Path, files: list[str]) -> bytes:
    """A tar of the manifest and the files it lists (what a later start checks it against)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for rel in [MANIFEST, *files]:
            tar.add(path / rel, arcname=rel)
    return buffer.getvalue()
