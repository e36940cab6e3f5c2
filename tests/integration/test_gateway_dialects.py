"""`teacherq serve` answering the dialects trainers already use, each request shaped exactly as
the trainer's code sends it and each answer read exactly as that code reads it (slime's OPD
reward client, SGLang's native API, the `openai` package against vLLM's completions, prime-rl's
`/inference/v1/generate`, TRL's `get_sequence_logprobs`), every value compared with the queue's
own results for the same tokens (TeacherClient). One real consumer and one real gateway process
serve the whole module."""

from __future__ import annotations

import asyncio
import base64
import math
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx2  # the HTTP library of openai 3.x (prime-rl's openai 1.x used httpx)
import numpy as np
import openai
import pytest
import requests

from producer import TeacherRequest
from shared.messages import TeacherResult
from tests.gateway import Served, serve_queue
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration

ATOL = 1e-5  # the same consumer computes both sides; batch composition may move the last bits
IDS = [3, 14, 15, 92, 65, 35, 89, 79]
IDS2 = [2, 71, 82, 81, 8]


@pytest.fixture(scope="module")
def served(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One consumer (the tiny preset, large batches for the burst) and one gateway on a queue
    of this module."""
    with serve_queue(
        redis_url,
        tmp_path_factory.mktemp("dialects"),
        consumer={"batch_max_jobs": 1024},
        queue={"trace_sample_rate": 0.0},  # no spans recorded: this module reads answers only
    ) as served:
        yield served


def test_sglang_opd_request_as_slime_sends_it(served: Served) -> None:
    """slime's on-policy-distillation reward: SGLang's /generate with return_logprob and
    logprob_start_len 0, read as slime reads it (`meta_info.input_token_logprobs[1:]`, item 0
    of each) equals the queue's log-probs at T = 1 although sampling_params says 0.6; the
    answer has SGLang's shape (text, output_ids, meta_info, [null, id, null] first)."""
    status, reward = served.http.call(
        "POST",
        "/generate",
        {
            "input_ids": IDS,
            "sampling_params": {
                "temperature": 0.6,
                "max_new_tokens": 0,
                "skip_special_tokens": False,
            },
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert status == 200, reward
    teacher = [item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]]
    ref = served.reference(input_ids=IDS)
    np.testing.assert_allclose(teacher, ref.logprobs, rtol=0, atol=ATOL)
    meta = reward["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, IDS[0], None]
    assert [e[1] for e in meta["input_token_logprobs"]] == IDS
    assert all(e[2] is None for e in meta["input_token_logprobs"])
    assert reward["text"] == "" and reward["output_ids"] == []
    assert meta["prompt_tokens"] == len(IDS) and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["input_logprob_temperature"] == 1.0


def test_sglang_batch_top_and_token_ids_logprobs(served: Served) -> None:
    """A batch answers a list in order; per item logprob_start_len (2, and -1 meaning the last
    token), top_logprobs_num and token_ids_logprob give SGLang's nested [logprob, id, null]
    rows with null at entry 0, equal to the queue's top-k and label log-probs."""
    status, out = served.http.call(
        "POST",
        "/generate",
        {
            "input_ids": [IDS, IDS2],
            "rid": ["first", "second"],
            "return_logprob": True,
            "logprob_start_len": [2, -1],
            "top_logprobs_num": 3,
            "token_ids_logprob": [5, 7],
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    assert status == 200, out
    assert [o["meta_info"]["id"] for o in out] == ["first", "second"]
    ref = served.reference(input_ids=IDS, top_k=3, label_token_ids=[[5, 7]] * (len(IDS) - 1))
    m = out[0]["meta_info"]
    assert m["input_token_logprobs"][0] == [None, IDS[2], None]
    np.testing.assert_allclose(
        [e[0] for e in m["input_token_logprobs"][1:]], ref.logprobs[2:], rtol=0, atol=ATOL
    )
    top = m["input_top_logprobs"]
    assert top[0] is None and len(top) == len(IDS) - 2
    np.testing.assert_allclose(
        [[t[0] for t in row] for row in top[1:]], ref.topk_logprobs[2:], rtol=0, atol=ATOL
    )
    assert [[t[1] for t in row] for row in top[1:]] == ref.topk_token_ids[2:].tolist()
    labels = m["input_token_ids_logprobs"]
    assert labels[0] is None and all([t[1] for t in row] == [5, 7] for row in labels[1:])
    np.testing.assert_allclose(
        [[t[0] for t in row] for row in labels[1:]], ref.label_logprobs[2:], rtol=0, atol=ATOL
    )
    last = out[1]["meta_info"]
    assert last["input_token_logprobs"] == [[None, IDS2[-1], None]]
    assert last["input_top_logprobs"] == [None]


def test_sglang_flat_top_logprobs_and_temperature(served: Served) -> None:
    """return_flat_raw_top_logprobs (plain and base64) replaces input_top_logprobs by the
    rows after the null prefix, flat; input_logprob_temperature applies T and is echoed."""
    ref = served.reference(input_ids=IDS, top_k=2)
    base = {
        "input_ids": IDS,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_flat_raw_top_logprobs": True,
    }
    status, out = served.http.call("POST", "/generate", base)
    assert status == 200, out
    m = out["meta_info"]
    assert "input_top_logprobs" not in m
    assert m["input_top_logprobs_shape"] == [len(IDS), 2]
    assert m["input_top_logprobs_null_prefix"] == 1
    np.testing.assert_allclose(
        m["input_top_logprobs_val_flat"], ref.topk_logprobs.ravel(), rtol=0, atol=ATOL
    )
    assert m["input_top_logprobs_idx_flat"] == ref.topk_token_ids.ravel().tolist()

    status, out = served.http.call(
        "POST", "/generate", {**base, "return_flat_raw_top_logprobs_b64": True}
    )
    assert status == 200, out
    m = out["meta_info"]
    rows, k = m["input_top_logprobs_shape"]
    val = np.frombuffer(
        base64.b64decode(m["input_top_logprobs_val_flat_b64"]),
        dtype=np.dtype(m["input_top_logprobs_val_flat_b64_dtype"]),
    ).reshape(rows - m["input_top_logprobs_null_prefix"], k)
    idx = np.frombuffer(
        base64.b64decode(m["input_top_logprobs_idx_flat_b64"]),
        dtype=np.dtype(m["input_top_logprobs_idx_flat_b64_dtype"]),
    ).reshape(rows - 1, k)
    np.testing.assert_allclose(val, ref.topk_logprobs, rtol=0, atol=ATOL)
    np.testing.assert_array_equal(idx, ref.topk_token_ids)

    hot = served.reference(input_ids=IDS, temperature=0.5)
    status, out = served.http.call(
        "POST",
        "/generate",
        {
            "input_ids": IDS,
            "return_logprob": True,
            "logprob_start_len": 0,
            "input_logprob_temperature": 0.5,
        },
    )
    assert status == 200, out
    assert out["meta_info"]["input_logprob_temperature"] == 0.5
    np.testing.assert_allclose(
        [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]],
        hot.logprobs,
        rtol=0,
        atol=ATOL,
    )
    assert not np.allclose(hot.logprobs, ref.logprobs, atol=1e-3)  # the temperature mattered


def test_sglang_refusals_and_info_routes(served: Served) -> None:
    """What teacherq cannot do is refused in one line naming the field (generation, text,
    a start past the input), in SGLang's error shape; /health_generate and /get_model_info
    answer."""
    for body, want in (
        (
            {"input_ids": IDS, "return_logprob": True, "sampling_params": {"max_new_tokens": 8}},
            "max_new_tokens",
        ),
        ({"input_ids": IDS, "return_logprob": True, "return_text_in_logprobs": True}, "tokenizer"),
        ({"text": "hello", "return_logprob": True}, "tokenizer"),
        ({"input_ids": IDS, "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
        (
            {"input_ids": IDS, "return_logprob": True, "input_logprob_temperature": 0},
            "input_logprob_temperature",
        ),
    ):
        status, out = served.http.call("POST", "/generate", body)
        assert status == 400 and want in out["error"]["message"], (body, status, out)
    assert served.http.call("GET", "/health_generate")[0] == 200
    status, info = served.http.call("GET", "/get_model_info")
    assert status == 200 and info["is_generation"] is True
    assert (
        info["weight_version"]
        == served.client.r.hget(
            f"teacherq:{{{served.settings.queue.name}}}:model", "version"
        ).decode()
    )


def _vllm_entry_check(
    entry: dict[str, Any], token: int, row: int, ref: TeacherResult, k: int
) -> None:
    """One vLLM prompt_logprobs position: the actual token first, then the k best by rank."""
    keys = list(entry)
    assert keys[0] == str(token)
    assert math.isclose(entry[str(token)]["logprob"], ref.logprobs[row], abs_tol=ATOL)
    for r in range(k):
        t = str(int(ref.topk_token_ids[row, r]))
        assert entry[t]["rank"] == r + 1
        assert math.isclose(entry[t]["logprob"], ref.topk_logprobs[row, r], abs_tol=ATOL)
        assert entry[t]["decoded_token"] is None


def test_vllm_completions_with_the_openai_client(served: Served) -> None:
    """The `openai` package's client: /v1/models names the model; /v1/completions with two
    token-id prompts, max_tokens 1 and prompt_logprobs 2 answers one choice per prompt in
    order with vLLM's prompt_logprobs (null, then the actual token first and the top 2 by
    rank) at T = 1 whatever temperature says; echo + logprobs answers OpenAI's logprobs
    object over the prompt; text prompts and generation are refused as BadRequestError."""
    oc = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    name = oc.models.list().data[0].id
    comp = oc.completions.create(
        model=name,
        prompt=[IDS, IDS2],
        max_tokens=1,
        temperature=0.7,
        extra_body={"prompt_logprobs": 2},
    )
    assert [c.index for c in comp.choices] == [0, 1]
    assert comp.usage is not None and comp.usage.prompt_tokens == len(IDS) + len(IDS2)
    for choice, ids in zip(comp.choices, (IDS, IDS2), strict=True):
        ref = served.reference(input_ids=ids, top_k=2)
        plp = choice.prompt_logprobs  # type: ignore[attr-defined]  # vLLM's extra field
        assert plp[0] is None and len(plp) == len(ids)
        for pos in range(1, len(ids)):
            _vllm_entry_check(plp[pos], ids[pos], pos - 1, ref, 2)
        assert choice.text == "" and choice.finish_reason == "length"

    echo = oc.completions.create(model=name, prompt=IDS, max_tokens=1, echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    assert lp is not None and lp.tokens == [f"token_id:{t}" for t in IDS]
    ref = served.reference(input_ids=IDS, top_k=1)
    assert lp.token_logprobs is not None and lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], ref.logprobs, rtol=0, atol=ATOL)
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    for row, top in enumerate(lp.top_logprobs[1:]):
        best = f"token_id:{int(ref.topk_token_ids[row, 0])}"
        assert math.isclose(top[best], ref.topk_logprobs[row, 0], abs_tol=ATOL)

    with pytest.raises(openai.BadRequestError, match="tokenizer"):
        oc.completions.create(model=name, prompt="hello", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oc.completions.create(model=name, prompt=IDS, max_tokens=16)


def test_prime_rl_generate_as_prime_rl_calls_it(served: Served) -> None:
    """prime-rl's teacher log-probs: `client.post(<root>/inference/v1/generate, cast_to=
    httpx2.Response, body={model, token_ids, sampling_params{max_tokens 1, temperature 1,
    top_p 1, prompt_logprobs 1}})`, read as prime-rl reads it (top-level prompt_logprobs, one
    per token, null first, the actual token's entry by str(id)) equals the queue's."""
    oc = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    body = {
        "model": "teacher",
        "token_ids": IDS,
        "sampling_params": {
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "prompt_logprobs": 1,
        },
    }

    async def call() -> Any:
        base = str(oc.base_url).rstrip("/")
        resp = await oc.post(
            f"{base.removesuffix('/v1')}/inference/v1/generate", cast_to=httpx2.Response, body=body
        )
        resp.raise_for_status()
        return resp.json()

    response = asyncio.run(call())
    prompt_logprobs = response.get("prompt_logprobs") or []
    assert len(prompt_logprobs) == len(IDS)
    flat = []
    for i, (token_id, entry) in enumerate(zip(IDS, prompt_logprobs, strict=True)):
        if not entry:
            assert i == 0
            flat.append(0.0)
            continue
        flat.append(float(entry[str(token_id)]["logprob"]))
    ref = served.reference(input_ids=IDS, top_k=1)
    np.testing.assert_allclose(flat[1:], ref.logprobs, rtol=0, atol=ATOL)


def _trl_post(served: Served, **payload: Any) -> dict[str, Any]:
    # As TRL's VLLMClient: a requests session posting JSON to /get_sequence_logprobs/.
    resp = requests.Session().post(
        f"{served.url}/get_sequence_logprobs/", json=payload, timeout=scaled(120)
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_trl_sequence_logprobs_binary_and_json(served: Served) -> None:
    """TRL's distillation request (sequences, prompt_lengths, top_logprobs, temperature,
    response_format) decoded as VLLMClient decodes it: binary top-k / actual arrays of shape
    [batch, longest completion, k] trimmed by completion_lengths, and JSON rows (top k by
    rank, then the actual token when outside them), equal to the queue's at T = 1; a prompt
    length of 0 gives the first position no log-prob."""
    seqs, lengths, k = [IDS, IDS2], [3, 0], 3
    refs = [served.reference(input_ids=s, top_k=k) for s in seqs]
    resp = _trl_post(
        served,
        sequences=seqs,
        prompt_lengths=lengths,
        top_logprobs=k,
        temperature=0.8,
        response_format="binary",
    )
    shape = resp["shape"]
    assert shape == [2, len(IDS2), k] and resp["completion_lengths"] == [len(IDS) - 3, len(IDS2)]
    lps = np.frombuffer(base64.b64decode(resp["logprobs_b64"]), dtype=np.float32).reshape(shape)
    ids = np.frombuffer(base64.b64decode(resp["token_ids_b64"]), dtype=np.int32).reshape(shape)
    act = np.frombuffer(base64.b64decode(resp["actual_logprobs_b64"]), dtype=np.float32).reshape(
        shape[0], shape[1], 1
    )
    act_ids = np.frombuffer(base64.b64decode(resp["actual_token_ids_b64"]), dtype=np.int32).reshape(
        shape[0], shape[1], 1
    )
    for i, (seq, pl, ref) in enumerate(zip(seqs, lengths, refs, strict=True)):
        for t in range(resp["completion_lengths"][i]):
            pos = pl + t
            if pos == 0:
                assert np.isneginf(lps[i, t]).all() and np.isneginf(act[i, t, 0])
                continue
            np.testing.assert_allclose(lps[i, t], ref.topk_logprobs[pos - 1], rtol=0, atol=ATOL)
            np.testing.assert_array_equal(ids[i, t], ref.topk_token_ids[pos - 1])
            assert math.isclose(act[i, t, 0], ref.logprobs[pos - 1], abs_tol=ATOL)
            assert act_ids[i, t, 0] == seq[pos]

    out = _trl_post(
        served, sequences=seqs, prompt_lengths=lengths, top_logprobs=k, response_format="json"
    )
    for i, (seq, pl, ref) in enumerate(zip(seqs, lengths, refs, strict=True)):
        rows, row_ids = out["logprobs"][i], out["logprob_token_ids"][i]
        assert len(rows) == len(seq) - pl
        for t, (vals, tids) in enumerate(zip(rows, row_ids, strict=True)):
            pos = pl + t
            if pos == 0:
                assert vals == [] and tids == []
                continue
            top = ref.topk_token_ids[pos - 1].tolist()
            assert tids[:k] == top
            np.testing.assert_allclose(vals[:k], ref.topk_logprobs[pos - 1], rtol=0, atol=ATOL)
            if seq[pos] not in top:
                assert tids[k] == seq[pos]
                assert math.isclose(vals[k], ref.logprobs[pos - 1], abs_tol=ATOL)
    assert served.http.call("GET", "/health/") == (200, {"status": "ok"})


def test_trl_1_16_client_path_via_completions(served: Served) -> None:
    """TRL 1.16's VLLMClient.get_sequence_logprobs posts /v1/completions {model, prompt:
    sequences, max_tokens 1, temperature, prompt_logprobs: k} and slices each choice's
    prompt_logprobs from the prompt length, sorting by rank: the values equal the queue's."""
    seqs, lengths, k = [IDS, IDS2], [2, 1], 2
    model = requests.get(f"{served.url}/v1/models", timeout=scaled(30)).json()["data"][0]["id"]
    payload = {
        "model": model,
        "prompt": seqs,
        "max_tokens": 1,
        "temperature": 0.9,
        "prompt_logprobs": k,
    }
    choices = requests.post(
        f"{served.url}/v1/completions", json=payload, timeout=scaled(120)
    ).json()["choices"]
    for choice, seq, pl in zip(choices, seqs, lengths, strict=True):
        ref = served.reference(input_ids=seq, top_k=k)
        for position in range(pl, len(choice["prompt_logprobs"])):
            position_logprobs = choice["prompt_logprobs"][position] or {}
            items = sorted(position_logprobs.items(), key=lambda item: item[1]["rank"])[:k]
            assert [int(t) for t, _ in items] == ref.topk_token_ids[position - 1].tolist()
            np.testing.assert_allclose(
                [it["logprob"] for _, it in items],
                ref.topk_logprobs[position - 1],
                rtol=0,
                atol=ATOL,
            )
            actual = position_logprobs.get(str(seq[position]))
            assert actual is not None
            assert math.isclose(actual["logprob"], ref.logprobs[position - 1], abs_tol=ATOL)


def test_slime_coercions_and_zero_width_labels(served: Served) -> None:
    """slime's own coercions hold: sample_n 2.5 is int(2.5) = 2, label ids given as numeric
    strings count as ints, zero-width labels answer [[]] * (L-1); /get_loads adds
    total_finished_tokens; the slime dialect keeps its server-wide temperature (1.0 here)."""
    labels = [[str(t), str((t + 1) % 1000)] for t in IDS[1:]]
    status, out = served.http.call(
        "POST", "/generate", {"input_ids": IDS, "sample_n": 2.5, "label_token_ids": labels}
    )
    assert status == 200, out
    assert np.array(out["sampled_token_ids"]).shape == (len(IDS) - 1, 2)
    ref = served.reference(input_ids=IDS, label_token_ids=[[int(a), int(b)] for a, b in labels])
    np.testing.assert_allclose(out["label_token_log_probs"], ref.label_logprobs, rtol=0, atol=ATOL)
    np.testing.assert_allclose(out["log_probs"], ref.logprobs, rtol=0, atol=ATOL)
    status, out = served.http.call(
        "POST", "/generate", {"input_ids": IDS, "label_token_ids": [[] for _ in IDS[1:]]}
    )
    assert status == 200 and out["label_token_log_probs"] == [[]] * (len(IDS) - 1), out
    # The consumers' token counters reach Redis with their next heartbeat.
    wait_until(
        lambda: served.http.call("GET", "/get_loads")[1]["total_finished_tokens"] > 0,
        "total_finished_tokens counting the scored tokens",
    )


def test_burst_of_4096_requests_across_dialects(served: Served) -> None:
    """4,096 concurrent requests over the four dialects against one gateway: every one is
    answered 200 (no reset, no error), each answer equal to the queue's result for its
    tokens."""
    prompts = [[(7 * i + j) % 997 + 1 for j in range(2 + i % 3)] for i in range(32)]
    refs = served.references([TeacherRequest(input_ids=p, top_k=1) for p in prompts])

    def shaped(i: int) -> tuple[str, dict[str, Any]]:
        p = prompts[i % len(prompts)]
        kind = i % 4
        if kind == 0:
            return "/generate", {"input_ids": p}
        if kind == 1:
            return "/generate", {
                "input_ids": p,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0},
            }
        if kind == 2:
            return "/v1/completions", {
                "model": "m",
                "prompt": p,
                "max_tokens": 1,
                "prompt_logprobs": 0,
            }
        return "/get_sequence_logprobs/", {
            "sequences": [p],
            "prompt_lengths": [1],
            "top_logprobs": 1,
        }

    def logprobs(i: int, body: dict[str, Any]) -> list[float]:
        p, kind = prompts[i % len(prompts)], i % 4
        if kind == 0:
            return body["log_probs"]
        if kind == 1:
            return [e[0] for e in body["meta_info"]["input_token_logprobs"][1:]]
        if kind == 2:
            return [
                e[str(t)]["logprob"]
                for t, e in zip(p[1:], body["choices"][0]["prompt_logprobs"][1:], strict=True)
            ]
        return [row[0] for row in body["logprobs"][0]]  # top-1 rows, compared with the top-1 below

    async def burst() -> list[tuple[int, Any]]:
        conn = aiohttp.TCPConnector(limit=1024)
        timeout = aiohttp.ClientTimeout(total=scaled(300))
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

            async def one(i: int) -> tuple[int, Any]:
                path, body = shaped(i)
                async with session.post(served.url + path, json=body) as resp:
                    return resp.status, await resp.json()

            return await asyncio.gather(*(one(i) for i in range(4096)))

    before = served.http.call("GET", "/get_loads")[1]
    # The embedded server has no replica, and nothing asks for one: no write waits.
    assert before["replication"]["replicas"] == 0 and before["replication"]["waiting_s"] == 0
    assert before["replication"]["min_replicas_acked"] == 0
    answers = asyncio.run(burst())
    assert [s for s, _ in answers].count(200) == 4096, [a for a in answers if a[0] != 200][:3]
    after = served.http.call("GET", "/get_loads")[1]
    jobs = after["gateway_jobs"] - before["gateway_jobs"]
    submits = after["gateway_submits"] - before["gateway_submits"]
    assert jobs == 4096 and submits <= jobs / 8, (submits, jobs)  # batched, not one each
    for i, (_, body) in enumerate(answers):
        ref = refs[i % len(prompts)]
        want = ref.topk_logprobs[:, 0] if i % 4 == 3 else ref.logprobs
        np.testing.assert_allclose(logprobs(i, body), want, rtol=0, atol=ATOL, err_msg=str(i))
