"""The client protocol both clients share (producer/protocol.py): job naming across weight
generations, validation before anything is enqueued, the completion-stream parser."""

from __future__ import annotations

import pytest

from producer import protocol
from shared.errors import InvalidJob
from shared.messages import Limits, TeacherRequest, content_job_id
from shared.settings import Settings
from shared.weights import Served

SETTINGS = Settings(queue={"name": "q"}, model={"path": "/ckpt/a"})
LIMITS = Limits(vocab_size=100)


def _prepare(reqs: list, generation: int) -> list[protocol.Prepared]:
    return protocol.prepare(reqs, limits=LIMITS, settings=SETTINGS, generation=generation)


def test_content_ids_change_with_the_weight_generation_and_ask_for_it() -> None:
    """The same content is one job within a generation and another job in the next; each asks
    for at least the generation it was named in; generation 0 keeps the ids from before
    generations were hashed."""
    req = TeacherRequest(input_ids=[1, 2, 3])
    [g0] = _prepare([req], 0)
    [g0_again] = _prepare([req.model_dump()], 0)
    [g1] = _prepare([req], 1)
    [g2] = _prepare([req], 2)
    assert g0.job_id == g0_again.job_id == content_job_id(req, queue="q", teacher="/ckpt/a")
    assert len({g0.job_id, g1.job_id, g2.job_id}) == 3
    assert (g0.min_generation, g1.min_generation, g2.min_generation) == (0, 1, 2)
    # A higher minimum asked by the caller is kept.
    [keep] = _prepare([TeacherRequest(input_ids=[1, 2, 3], min_model_generation=5)], 2)
    assert keep.min_generation == 5


def test_own_job_ids_are_kept_across_generations() -> None:
    """A caller's job id is never renamed, and its minimum generation is the caller's."""
    req = TeacherRequest(input_ids=[1, 2, 3], job_id="mine")
    [p] = _prepare([req], 3)
    assert p.job_id == "mine" and p.min_generation == 0


def test_one_bad_request_names_its_index() -> None:
    """Validation covers every request first; the error names the bad one's index."""
    with pytest.raises(InvalidJob, match=r"request 1: input_ids\[2\] = 100 is outside"):
        _prepare([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 100]}], 0)


def test_announced_reads_job_ids_and_keeps_the_cursor() -> None:
    """An XREAD reply gives its job ids in order and the last entry id as the new cursor; an
    empty reply leaves the cursor alone."""
    reply = [(b"done", [(b"1-0", {b"job_id": b"a"}), (b"2-0", {b"job_id": b"b"})])]
    assert protocol.announced(reply, "0-0") == (b"2-0", ["a", "b"])
    assert protocol.announced(None, b"2-0") == (b"2-0", [])


def test_backpressure_rule() -> None:
    """Room while pending + new stays within the bound; an empty queue takes any job."""
    s = Settings(queue={"max_pending_tokens": 10})
    assert protocol.has_room(4, 6, s) and not protocol.has_room(5, 6, s)
    assert protocol.has_room(0, 50, s)


def test_jobs_are_named_after_the_generation_replicas_serve() -> None:
    """The generation a content id carries is the active one: a running update (not served
    yet) and a failed one (never served) do not count, or a job could ask for a generation no
    replica will ever serve and wait forever."""
    assert protocol.job_generation(Served(path=None, generation=0, state="idle")) == 0
    done = Served(path="/b", generation=2, state="done", active_path="/b", active_generation=2)
    assert protocol.job_generation(done) == 2
    running = Served(
        path="/c", generation=3, state="updating", active_path="/b", active_generation=2
    )
    failed = Served(path="/c", generation=3, state="failed", active_path="/b", active_generation=2)
    assert protocol.job_generation(running) == protocol.job_generation(failed) == 2


def test_units_group_only_jobs_that_share_a_prompt() -> None:
    """Adjacent jobs with one prefix_id, or the same first consumer.min_shared_prefix tokens,
    form one unit (one transaction); every other job is a unit of its own; a unit holds at
    most SUBMIT_CHUNK jobs."""
    s = Settings(consumer={"min_shared_prefix": 4})
    prompt = list(range(10, 20))
    reqs = [
        TeacherRequest(input_ids=prompt + [1]),
        TeacherRequest(input_ids=prompt + [2]),
        TeacherRequest(input_ids=[7, 8, 9]),
        TeacherRequest(input_ids=[7, 8, 9, 10], prefix_id="p"),
        TeacherRequest(input_ids=[1, 2, 3, 4], prefix_id="p"),
        TeacherRequest(input_ids=[5, 6, 7]),
    ]
    prepared = protocol.prepare(reqs, limits=LIMITS, settings=s, generation=0)
    sizes = [len(u) for u in protocol.units(prepared, s)]
    assert sizes == [2, 1, 2, 1]
    big = [TeacherRequest(input_ids=prompt + [i % 90]) for i in range(protocol.SUBMIT_CHUNK + 3)]
    prepared = protocol.prepare(big, limits=LIMITS, settings=s, generation=0)
    assert [len(u) for u in protocol.units(prepared, s)] == [protocol.SUBMIT_CHUNK, 3]


def test_memory_is_checked_before_the_first_unit_then_every_64_jobs() -> None:
    """One INFO round trip before the first unit, then one each time the running count
    crosses a multiple of MEMORY_CHECK_EVERY."""
    every = protocol.MEMORY_CHECK_EVERY
    assert protocol.memory_check_due(0, 1)
    assert not protocol.memory_check_due(1, 1)
    assert protocol.memory_check_due(every - 1, 1)
    assert protocol.memory_check_due(10, every)
