"""Independent references for numerics: the same model's full logits through log_softmax."""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from consumer import cpu_compat
    from consumer.model import TINY, TINY_SEED, build_model
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
