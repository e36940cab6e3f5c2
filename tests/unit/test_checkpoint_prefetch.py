"""The start-up prefetch (consumer/checkpoints/prefetch.py): it brings every page of a local
Hugging Face checkpoint's safetensors files into the page cache, runs only where it should,
stops when told, and prefetches the weights this start will serve."""

from __future__ import annotations

import json
import mmap
import os
import threading
from pathlib import Path

import pytest
import redis

from consumer.__main__ import prefetch_path
from consumer.checkpoints import page_cache, prefetch
from shared import weights
from tests.helpers import cached_pages, evict_every_page, unreclaimed
from tests.timing import wait_until

MIB = 1 << 20


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A directory shaped like a Hugging Face checkpoint: config.json and two shards (the
    prefetch reads bytes, it does not parse them), with an odd length at the end."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (root / "model-00001-of-00002.safetensors").write_bytes(os.urandom(3 * MIB))
    (root / "model-00002-of-00002.safetensors").write_bytes(os.urandom(2 * MIB + 12345))
    (root / "notes.txt").write_bytes(os.urandom(MIB))  # not a weight file: not read
    return root


def _shards(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def _pages(path: Path) -> int:
    return -(-path.stat().st_size // mmap.PAGESIZE)


def test_every_page_of_the_shards_is_brought_in(checkpoint):
    shards = _shards(checkpoint)

    def prefetch_cold() -> list[int]:
        evict_every_page([*shards, checkpoint / "notes.txt"])
        ahead = prefetch.start(str(checkpoint), threads=3, begin=False)  # as __main__ does
        assert ahead is not None and ahead.files == shards and not ahead.done
        assert ahead.bytes_read == 0
        ahead.start()  # as the consumer starts it, after the import
        wait_until(lambda: ahead.done, "the prefetch to finish")
        ahead.stop()
        assert ahead.bytes_read == ahead.total == sum(f.stat().st_size for f in shards)
        assert ahead.failed == 0
        return [cached_pages(shard, 0, shard.stat().st_size) for shard in shards]

    assert unreclaimed(prefetch_cold) == [_pages(shard) for shard in shards]
    notes = checkpoint / "notes.txt"
    assert cached_pages(notes, 0, notes.stat().st_size) == 0, "a file that is not a shard was read"


def test_the_libraries_come_first_and_count_apart(checkpoint, tmp_path):
    """`first` (the libraries torch loads) is read too, before the shards, and counted apart
    from the checkpoint's bytes."""
    library = tmp_path / "libtorch_fake.so"
    library.write_bytes(os.urandom(MIB + 7))
    shards = _shards(checkpoint)

    def prefetch_cold() -> list[int]:
        evict_every_page([library, *shards])
        ahead = prefetch.start(str(checkpoint), first=[library, tmp_path / "gone.so"], threads=1)
        assert ahead is not None
        wait_until(lambda: ahead.done, "the prefetch to finish")
        ahead.stop()
        assert ahead.first_bytes == MIB + 7 and ahead.bytes_read == ahead.total
        return [cached_pages(f, 0, f.stat().st_size) for f in (library, *shards)]

    assert unreclaimed(prefetch_cold) == [_pages(f) for f in (library, *shards)]


def test_it_waits_for_another_thread_and_stops_when_told(checkpoint):
    """Threads start reading after `after` (another thread); a stop before then leaves
    everything unread, and the threads are gone."""
    gate = threading.Event()
    libraries = threading.Thread(target=gate.wait, daemon=True)
    libraries.start()
    ahead = prefetch.start(str(checkpoint), after=libraries)
    assert ahead is not None and not ahead.done
    stopper = threading.Thread(target=ahead.stop)
    stopper.start()
    wait_until(lambda: ahead.stopped, "the stop to be requested")
    gate.set()
    stopper.join(timeout=30)
    assert not stopper.is_alive() and ahead.done
    assert ahead.bytes_read == 0


def test_it_runs_only_where_it_cannot_hurt(checkpoint, tmp_path, monkeypatch):
    assert prefetch.start(str(checkpoint), enabled=False) is None
    assert prefetch.start(None) is None
    megatron = tmp_path / "megatron"  # no config.json: not a Hugging Face directory
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("1")
    assert prefetch.start(str(megatron)) is None
    assert prefetch.start(str(tmp_path / "missing")) is None
    monkeypatch.setenv("LOCAL_RANK", "1")  # one rank per machine reads
    assert prefetch.start(str(checkpoint)) is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    # a checkpoint that would fill more than half the memory left is the loader's alone
    total = sum(f.stat().st_size for f in _shards(checkpoint))
    monkeypatch.setattr(page_cache, "available_memory", lambda: 2 * total - 1)
    assert prefetch.start(str(checkpoint)) is None
    monkeypatch.setattr(page_cache, "available_memory", lambda: 2 * total)
    ahead = prefetch.start(str(checkpoint))
    assert ahead is not None
    ahead.stop()


def test_available_memory_is_what_the_kernel_says_at_most():
    found = page_cache.available_memory()
    assert found is not None and found > 0
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    # the kernel's figure moves between the two reads; a cgroup may leave less
    assert found <= meminfo["MemTotal"]


def test_the_weights_this_start_serves_are_prefetched(settings, checkpoint, tmp_path):
    """The queue's update in progress (or the one it serves) is what a start loads, so it is
    what the prefetch reads; without one, `model.path`."""
    s = settings.model_copy(
        update={"model": settings.model.model_copy(update={"path": str(checkpoint)})}
    )
    client = redis.Redis.from_url(settings.redis.url)
    assert prefetch_path(s, None) == str(checkpoint)
    assert prefetch_path(s, client) == str(checkpoint)
    update = tmp_path / "update"
    weights.request_update(client, s.queue.name, str(update))
    assert prefetch_path(s, client) == str(update)
