"""Independent references for numerics: the same model's full logits through log_softmax."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from consumer import cpu_compat
    from consumer.forward.model import TINY, TINY_SEED, build_model
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=1, pp=1)  # a world of one in the test process
    return build_model(TINY, layout, seed=TINY_SEED), TINY


@torch.inference_mode()
def tiny_full_log_softmax(input_ids: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """[L-1, vocab] float64 log-probs of the tiny preset, scored alone (no packing), from the
    full gathered logits: the path teacherq avoids, used here as the reference."""
    model, spec = _tiny_model()
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.int64)[None]
    hidden = model(ids, torch.arange(ids.shape[1])[None], attention_mask=None)[:, 0]
    logits = hidden.double() @ model.output_weight_shard().double().T
    logits = logits[:-1, : spec.vocab_size] / temperature
    return torch.log_softmax(logits, dim=-1).numpy()


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@torch.inference_mode()
def hf_full_log_softmax(path, input_ids, temperature: float = 1.0) -> np.ndarray:
    """[L-1, vocab] float64 log-probs of the Hugging Face checkpoint at `path`, computed by
    transformers itself (float32 forward, log_softmax in float64)."""
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.int64)[None]
    logits = _hf_model(str(path))(ids).logits[0, :-1].double()
    return torch.log_softmax(logits / temperature, dim=-1).numpy()


def hf_token_logprobs(path, input_ids) -> np.ndarray:
    """[L-1] log-prob transformers gives each next token of `input_ids`."""
    ids = np.asarray(input_ids)
    return hf_full_log_softmax(path, ids)[np.arange(len(ids) - 1), ids[1:]]


def dense_attention(q, k, v, segments) -> torch.Tensor:
    """[T, heads * dim]: row t sees its segment's context rows and its segment's rows <= t."""
    total = q.shape[0]
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, end, c0, c1 in segments:
        allowed[start:end, c0:c1] = True
        allowed[start:end, start:end] = torch.ones(end - start, end - start).tril().bool()
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v).reshape(total, -1)


def packed_segments(spec: list[tuple[int, int | None]]) -> tuple[tuple[int, int, int, int], ...]:
    """(length, index of the context segment or None) -> packed segments."""
    out: list[tuple[int, int, int, int]] = []
    at = 0
    for n, ctx in spec:
        c0, c1 = (at, at) if ctx is None else out[ctx][:2]
        out.append((at, at + n, c0, c1))
        at += n
    return tuple(out)
