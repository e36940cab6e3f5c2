"""Fresh results after a weight update, end to end with a real consumer and a real reload: the
same tokens submitted after `update-weights` are computed by the new weights, a caller's own
job id stays idempotent, and `min_model_generation` recomputes a stored older result."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from producer import AsyncTeacherClient, TeacherClient, TeacherRequest
from tests.helpers import fast
from tests.reference import hf_token_logprobs
from tests.timing import scaled

pytestmark = pytest.mark.integration


@pytest.fixture
def teachers(hf_checkpoint):
    """Two different random qwen2 teachers (the session's, shared with test_groups)."""
    return hf_checkpoint("qwen2", "teacher-a", seed=1), hf_checkpoint("qwen2", "teacher-b", seed=2)


def test_same_tokens_after_update_weights_are_computed_by_the_new_weights(
    settings, start_consumer, teachers
) -> None:
    """Before the update, content-id and own-id jobs are computed by teacher A (generation 0).
    After `update_weights(B)`: the same content gets a new job id (the same from the sync and
    the async client) whose result is B's (generation 1), while the generation-0 result stays
    under the old id; the caller's own job id returns its stored A result (idempotent) until
    it asks for `min_model_generation=1`, which recomputes it with B."""
    a, b = teachers
    s = fast(settings).model_copy(
        update={"model": settings.model.model_copy(update={"path": str(a)})}
    )
    start_consumer(s)
    client = TeacherClient(s)
    tokens = np.array([11, 12, 13, 14, 15])
    mine = np.array([21, 22, 23, 24])
    content = TeacherRequest(input_ids=tokens)
    own = TeacherRequest(input_ids=mine, job_id="mine")
    old_id, own_id = client.submit([content, own])
    old, own_before = client.wait([old_id, own_id], timeout=scaled(120))
    for res, ids in ((old, tokens), (own_before, mine)):
        assert res.ok and res.model_generation == 0
        np.testing.assert_allclose(res.logprobs, hf_token_logprobs(a, ids), atol=1e-4)
    assert client.submit([content]) == [old_id]  # no update yet: still the same job

    client.update_weights(str(b), wait=True, timeout=scaled(120))

    [new_id] = client.submit([content])

    async def async_id() -> list[str]:
        async with AsyncTeacherClient(s) as ac:
            return await ac.submit([content])

    assert asyncio.run(async_id()) == [new_id]
    assert new_id != old_id
    [new] = client.wait([new_id], timeout=scaled(120))
    assert new.ok and new.model_generation == 1
    np.testing.assert_allclose(new.logprobs, hf_token_logprobs(b, tokens), atol=1e-4)
    assert not np.allclose(new.logprobs, old.logprobs, atol=1e-3), "A and B must differ"
    [kept] = client.results([old_id])
    assert kept is not None and kept.model_generation == 0

    assert client.submit([own]) == ["mine"]
    [same] = client.wait(["mine"], timeout=scaled(5))
    assert same.model_generation == 0  # a caller's own id is idempotent
    fresh_req = TeacherRequest(input_ids=mine, job_id="mine", min_model_generation=1)
    assert client.submit([fresh_req]) == ["mine"]
    [fresh] = client.wait(["mine"], timeout=scaled(120))
    assert fresh.ok and fresh.model_generation == 1
    np.testing.assert_allclose(fresh.logprobs, hf_token_logprobs(b, mine), atol=1e-4)
    # Asking again for generation 1 finds the stored generation-1 result: nothing recomputed.
    entries = client.r.xlen(client.streams.jobs)
    client.submit([fresh_req])
    assert client.r.xlen(client.streams.jobs) == entries


def test_a_failed_update_renames_nothing_and_a_failed_result_stays(
    settings, start_consumer, teachers, tmp_path
) -> None:
    """An update no replica can load fails and is never served: content ids keep the active
    generation (the same request is the same, stored job) and new content is computed at once
    by the weights still served, instead of waiting forever for the failed generation. A
    failed (cancelled) record is not recomputed by asking for a newer generation: replay is
    the way to rerun failures."""
    from shared.errors import WeightUpdateFailed

    a, b = teachers
    s = fast(settings).model_copy(
        update={"model": settings.model.model_copy(update={"path": str(a)})}
    )
    start_consumer(s)
    client = TeacherClient(s)
    client.update_weights(str(b), wait=True, timeout=scaled(120))  # generation 1, served
    content = TeacherRequest(input_ids=[31, 32, 33, 34])
    [job] = client.submit([content])
    [res] = client.wait([job], timeout=scaled(120))
    assert res.ok and res.model_generation == 1

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(WeightUpdateFailed):
        client.update_weights(
            str(broken), wait=True, timeout=scaled(120), check=False
        )  # generation 2
    assert client.submit([content]) == [job]  # still named after generation 1: nothing new
    [other] = client.submit([TeacherRequest(input_ids=[41, 42, 43])])
    [res] = client.wait([other], timeout=scaled(60))
    assert res.ok and res.model_generation == 1
    np.testing.assert_allclose(res.logprobs, hf_token_logprobs(b, [41, 42, 43]), atol=1e-4)

    [gone] = client.submit([TeacherRequest(input_ids=[51, 52, 53], job_id="gone")])
    client.cancel(gone)
    again = TeacherRequest(input_ids=[51, 52, 53], job_id="gone", min_model_generation=1)
    entries = client.r.xlen(client.streams.jobs)
    assert client.submit([again]) == ["gone"]
    assert client.r.xlen(client.streams.jobs) == entries  # the cancelled record stands
    [res] = client.wait(["gone"], timeout=scaled(5))
    assert res.error == "cancelled by the user"
