"""Helpers that test modules share (import them from here, never from conftest.py or from
another test module): the repository root, head calls from flat keyword arguments, ..."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def head(*, logits_TV: Any, **call: Any) -> Any:
    """`tp_ops.head_from_logits` with the `HeadCall` fields given as keyword arguments."""
    from consumer import tp_ops

    return tp_ops.head_from_logits(logits_TV=logits_TV, call=tp_ops.HeadCall(**call))


def chunked(*, hidden_TH: Any, weight_VH: Any, deferred: bool = False, **call: Any) -> Any:
    """`tp_ops.chunked_head` with the `HeadCall` fields given as keyword arguments."""
    from consumer import tp_ops

    return tp_ops.chunked_head(
        hidden_TH=hidden_TH, weight_VH=weight_VH, call=tp_ops.HeadCall(**call), deferred=deferred
    )
