"""Input-length limits and the parameter dtype, from settings and the served model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from consumer.forward.model import TINY
from consumer.serve.service import pick_dtype
from shared.messages import (
    DEFAULT_MAX_INPUT_TOKENS,
    InvalidJob,
    Limits,
    TeacherRequest,
    check_limits,
)
from shared.settings import QueueSettings, Settings


@pytest.mark.parametrize(
    ("setting", "model", "want", "source"),
    [
        (None, None, DEFAULT_MAX_INPUT_TOKENS, "queue.max_input_tokens"),
        (None, 32768, 32768, "the model's max_position_embeddings"),
        (100_000, 32768, 32768, "the model's max_position_embeddings"),
        (1000, 32768, 1000, "queue.max_input_tokens"),
        (1000, None, 1000, "queue.max_input_tokens"),
    ],
)
def test_queue_limit_is_the_setting_capped_by_the_model(setting, model, want, source) -> None:
    """An unset limit follows the model; a set one never exceeds it; the error names which."""
    limits = Limits.for_queue(
        QueueSettings(max_input_tokens=setting), vocab_size=None, model_max_tokens=model
    )
    assert (limits.max_input_tokens, limits.max_input_source) == (want, source)
    with pytest.raises(InvalidJob, match=rf"{want + 1} tokens; the maximum is {want} \({source}"):
        check_limits(TeacherRequest(input_ids=[1] * (want + 1)), limits)
    check_limits(TeacherRequest(input_ids=[1] * want), limits)


def test_rope_scaling_extends_the_models_limit() -> None:
    """A llama3/linear-scaled checkpoint takes factor x its original context."""
    plain = dataclasses.replace(TINY, max_position_embeddings=8192)
    assert plain.max_input_tokens == 8192
    scaled = dataclasses.replace(
        plain,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
        },
    )
    assert scaled.max_input_tokens == 65536
    # A config whose max_position_embeddings already states the extended context keeps it.
    assert dataclasses.replace(scaled, max_position_embeddings=131072).max_input_tokens == 131072


def test_dtype_defaults_to_bf16_on_cuda_and_fp32_on_cpu() -> None:
    """model.dtype=auto picks by device; an explicit dtype wins on either."""
    assert Settings().model.dtype == "auto"
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert pick_dtype("float32", torch.device("cuda", 0)) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
