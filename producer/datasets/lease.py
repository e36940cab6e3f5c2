"""The dataset lease: only one job works on a dataset at a time. The holder refreshes a key with
a short TTL, and its progress writes check the owner and write in one step (Lua), so a job that
lost the lease cannot move progress backwards."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis

from producer.client import TeacherClient
from producer.datasets.records import DatasetError, DatasetRecord, load_record
from shared import keys
from shared.errors import TeacherqError

LEASE_TTL_S = 10.0
LEASE_REFRESH_S = 2.0

_LEASE_REFRESH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_LEASE_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease, record, rejected. ARGV: token, ttl ms, 2n, n record field/values, then rejected
# row/reason pairs. Writes only while the caller still owns the lease (fencing: a job that
# lost its lease, e.g. a stalled one whose TTL ran out, cannot move progress backwards).
_FENCED_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local n = tonumber(ARGV[3])
if n > 0 then redis.call('HSET', KEYS[2], unpack(ARGV, 4, 3 + n)) end
if #ARGV > 3 + n then redis.call('HSET', KEYS[3], unpack(ARGV, 4 + n)) end
return 1
"""


class LeaseLost(TeacherqError):
    """Another job took over the dataset (this one stalled past the lease TTL)."""


class Lease:
    """Exclusive right to work on one dataset, kept alive by refresh() and fenced writes."""

    def __init__(self, r: redis.Redis, queue: str, dataset_id: str) -> None:
        self.r = r
        self.key = keys.dataset_lease_key(queue, dataset_id)
        self.record_key = keys.dataset_key(queue, dataset_id)
        self.rejected_key = keys.dataset_rejected_key(queue, dataset_id)
        self.token = uuid.uuid4().hex
        self._last = 0.0

    def acquire(self, *, wait_s: float) -> None:
        """Take the lease, waiting up to wait_s for a holder to finish or its TTL to lapse."""
        deadline = time.monotonic() + wait_s
        while not self.r.set(self.key, self.token, nx=True, px=int(LEASE_TTL_S * 1000)):
            if time.monotonic() > deadline:
                raise LeaseLost(f"{self.key} still held after {wait_s:.0f}s")
            time.sleep(0.5)  # a lock hand-over has no event to block on
        self._last = time.monotonic()

    def refresh(self, *, force: bool = False) -> None:
        """Extend the TTL (at most every LEASE_REFRESH_S unless forced); raise if lost."""
        if not force and time.monotonic() - self._last < LEASE_REFRESH_S:
            return
        ok = self.r.eval(_LEASE_REFRESH, 1, self.key, self.token, int(LEASE_TTL_S * 1000))
        if not ok:
            raise LeaseLost(f"lost {self.key}")
        self._last = time.monotonic()

    def write(self, fields: Mapping[str, Any], rejected: Iterable[tuple[int, str]] = ()) -> None:
        """Write record fields (and rejected rows) only while holding the lease."""
        argv: list[Any] = [self.token, int(LEASE_TTL_S * 1000)]
        flat = [x for kv in fields.items() for x in kv]
        argv += [len(flat), *flat]
        argv += [x for pair in rejected for x in pair]
        ok = self.r.eval(_FENCED_WRITE, 3, self.key, self.record_key, self.rejected_key, *argv)
        if not ok:
            raise LeaseLost(f"lost {self.key} before writing")
        self._last = time.monotonic()

    def release(self) -> None:
        """Give the lease up if still ours."""
        self.r.eval(_LEASE_RELEASE, 1, self.key, self.token)


@contextmanager
def leased(client: TeacherClient, dataset_id: str) -> Iterator[tuple[Lease, DatasetRecord]]:
    """Hold the dataset's lease for the block; yields it with the record as read under it."""
    rec = load_record(client.r, client.queue, dataset_id)
    if rec is None:
        raise DatasetError(f"no dataset {dataset_id!r} in queue {client.queue!r}")
    lease = Lease(client.r, client.queue, dataset_id)
    # Wait long enough for a live holder to end its slice (a duplicate of this job, e.g. the
    # orphaned work-horse of a killed worker) before giving up to rq's retry.
    lease.acquire(wait_s=rec.spec.slice_s + 3 * LEASE_TTL_S)
    try:
        fresh = load_record(client.r, client.queue, dataset_id)
        assert fresh is not None
        yield lease, fresh
    finally:
        lease.release()
