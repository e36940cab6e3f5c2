"""The compile cache kept in object storage (consumer/serve/cache_store.py), on file:// and on a
real S3 endpoint over HTTP: a fresh machine (an empty local cache) fetches the sealed archive
another machine stored, checks it against its manifest, and starts sealed with that machine's
plans; an archive that fails the check is never served from; another environment's archive is
never fetched; a seal that added nothing stores nothing."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import structlog

from consumer.serve import cache_store
from consumer.serve.compile_cache import MANIFEST, apply
from shared.settings import Settings, StorageSettings
from shared.storage import ObjectStore
from tests.s3_server import S3Server, s3_bucket_fixture, s3_server_fixture  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "gpu": "NVIDIA H200"}
PLAN = "plan-digest-1"


@pytest.fixture(params=["file", "s3"])
def settings(request, tmp_path: Path) -> Settings:
    """Settings whose consumer.compile_cache_url is a file:// directory or an S3 prefix."""
    if request.param == "file":
        url, storage = (tmp_path / "store").as_uri(), StorageSettings()
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        url = f"s3://{bucket}/compile-caches"
        storage = StorageSettings(
            url=url, endpoint=server.endpoint, region=server.region,
            access_key_id=server.access_key_id, secret_access_key=server.secret_access_key,
        )  # fmt: skip
    base = Settings()
    consumer = base.consumer.model_copy(update={"compile_cache_url": url})
    return base.model_copy(update={"consumer": consumer, "storage": storage})


def _machine(root: Path, key: dict[str, str] = KEY):
    """A consumer start on a machine whose local cache lives under `root`."""
    env: dict[str, str] = {}
    return apply(root, root, env, key=key), env


def _compile(env: dict[str, str], name: str, body: bytes) -> None:
    f = Path(env["TRITON_CACHE_DIR"]) / "HASH" / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(body)


def _stored(settings: Settings, root: Path, files: dict[str, bytes]):
    """(the store, the cache) after a machine at `root` compiled `files`, sealed its cache
    with PLAN and stored the archive."""
    store = cache_store.remote(settings)
    assert store is not None
    cache, env = _machine(root)
    for name, body in files.items():
        _compile(env, name, body)
    cache.seal(PLAN)
    cache_store.push(cache, store, wait=True)
    return store, cache


def test_a_fresh_machine_starts_from_the_archive_another_one_stored(
    settings: Settings, tmp_path: Path
) -> None:
    files = {"k.cubin": b"kernel bytes", "k.json": b"{}"}
    store, _ = _stored(settings, tmp_path / "a", files)

    fresh, env_b = _machine(tmp_path / "b")
    assert fresh.state == "new" and not fresh.holds(PLAN)
    with structlog.testing.capture_logs() as logs:
        pulled = cache_store.pull(fresh, store)
    assert pulled.state == "sealed" and pulled.opened == "pulled" and pulled.holds(PLAN)
    got = Path(env_b["TRITON_CACHE_DIR"]) / "HASH" / "k.cubin"  # where Triton will look
    assert got.read_bytes() == b"kernel bytes"
    assert [e["event"] for e in logs] == ["compile_cache.pulled"]
    assert not list((tmp_path / "b").glob("*.incoming-*"))


def test_a_pulled_kernel_is_found_where_the_fresh_machine_keeps_its_cache(
    settings: Settings, tmp_path: Path
) -> None:
    """Triton finds a kernel through its group file, which names the kernel's files by
    absolute path: on the machine that stored the archive, its own. Pulled into a cache
    under another directory, the group names the pulled files (else Triton would miss every
    kernel and compile again), and the manifest, updated to match, still checks: the next
    start finds the cache sealed, not corrupt."""
    store = cache_store.remote(settings)
    assert store is not None
    cache, env = _machine(tmp_path / "a")
    _compile(env, "k.cubin", b"kernel bytes")
    kernel = Path(env["TRITON_CACHE_DIR"]) / "HASH"
    (kernel / "__grp__k.json").write_text(
        json.dumps({"child_paths": {"k.cubin": str(kernel / "k.cubin")}})
    )
    cache.seal(PLAN)
    cache_store.push(cache, store, wait=True)

    fresh, env_b = _machine(tmp_path / "b")
    assert cache_store.pull(fresh, store).state == "sealed"
    here = Path(env_b["TRITON_CACHE_DIR"]) / "HASH"
    group = json.loads((here / "__grp__k.json").read_text())
    assert group == {"child_paths": {"k.cubin": str(here / "k.cubin")}}
    again, _ = _machine(tmp_path / "b")
    assert again.state == "sealed" and again.holds(PLAN)


def test_a_tampered_archive_is_refused_with_one_warning(settings: Settings, tmp_path: Path):
    store, first = _stored(settings, tmp_path / "a", {"k.cubin": b"kernel bytes"})
    # the same archive with one kernel's bytes changed after the seal
    name = cache_store.archive_name(first)
    buffer = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(store.get(name))) as original,
        tarfile.open(fileobj=buffer, mode="w") as tar,
    ):
        for member in original.getmembers():
            data = original.extractfile(member).read()  # type: ignore[union-attr]
            data = b"KERNEL BYTES" if member.name.endswith("k.cubin") else data
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    store.put(name, buffer.getvalue())

    fresh, env_b = _machine(tmp_path / "b")
    with structlog.testing.capture_logs() as logs:
        pulled = cache_store.pull(fresh, store)
    assert pulled is fresh and pulled.state == "new"
    refused = [e for e in logs if e["event"] == "compile_cache.pull_refused"]
    assert len(refused) == 1 and "checksum differs" in refused[0]["problems"][0]
    assert not (Path(env_b["TRITON_CACHE_DIR"]) / "HASH").exists()  # nothing served from it
    assert not list((tmp_path / "b").glob("*.incoming-*"))


def test_another_environment_never_fetches_the_archive(settings: Settings, tmp_path: Path):
    store, _ = _stored(settings, tmp_path / "a", {"k.cubin": b"kernel bytes"})
    other, _ = _machine(tmp_path / "b", key={**KEY, "triton": "3.7.0"})
    assert cache_store.pull(other, store).state == "new"


def test_a_seal_that_added_nothing_stores_nothing(settings: Settings, tmp_path: Path) -> None:
    from consumer.serve.service import seal

    store, first = _stored(settings, tmp_path / "a", {"k.cubin": b"kernel bytes"})
    name = cache_store.archive_name(first)
    store.delete(name)  # a push now would bring it back

    pulled_from = tmp_path / "c"
    fresh, _ = _machine(pulled_from)
    assert fresh.state == "new"
    first_again, _ = _machine(tmp_path / "a")  # a restart: sealed, same files and plan
    with structlog.testing.capture_logs() as logs:
        seal(first_again, None, store)  # no precompile plan: nothing new to record
    assert not store.exists(name) and not [e for e in logs if "pushed" in e["event"]]


def test_an_unusable_url_is_one_warning_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    base = Settings()
    consumer = base.consumer.model_copy(update={"compile_cache_url": (blocker / "x").as_uri()})
    with structlog.testing.capture_logs() as logs:
        assert cache_store.remote(base.model_copy(update={"consumer": consumer})) is None
    assert [e["setting"] for e in logs] == ["consumer.compile_cache_url"]


def test_the_archive_holds_the_manifest_and_what_it_lists(tmp_path: Path) -> None:
    store = ObjectStore.from_url((tmp_path / "store").as_uri())
    first, env = _machine(tmp_path / "a")
    _compile(env, "k.cubin", b"kernel bytes")
    _compile(env, "late.cubin", b"x")
    first.seal(PLAN)
    _compile(env, "after-the-seal.cubin", b"y")  # another rank's, sealed by the next start
    cache_store.push(first, store, wait=True)
    with tarfile.open(fileobj=io.BytesIO(store.get(cache_store.archive_name(first)))) as tar:
        names = set(tar.getnames())
        manifest = json.loads(tar.extractfile(MANIFEST).read())  # type: ignore[union-attr]
    assert names == {MANIFEST, *manifest["files"]}
    assert not any(n.endswith("after-the-seal.cubin") for n in names)
