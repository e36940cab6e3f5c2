"""Loading teacher weights safely: every rank of a group loads, or every rank keeps what it had.

A weight update (or a start-up on a queue's updated weights) must never take a replica down:
`load_agreed` runs the load on every rank of the tensor-parallel group and agrees on the
outcome with one tiny all-reduce (`consumer.group.agreement.agree`), so a checkpoint that fails on
any rank is dropped by all of them and the replica goes on serving its current weights.
`check_weights` is the cheap check a leader runs before telling its peers to load anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist

from consumer.group.agreement import agree

log = structlog.get_logger("teacherq.consumer")

T = TypeVar("T")


def describe(exc: BaseException) -> str:
    """One line for an operator: the error's type and message, cut to a readable length."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, ValueError | OSError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 500 else text[:497] + "..."


def load_agreed(
    load: Callable[[str], T],
    path: str,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    undo: Callable[[], None] | None = None,
) -> tuple[T | None, str | None]:
    """Run `load(path)` on every rank; `(value, None)` when every rank succeeded, else
    `(None, reason)` on every rank (the reason is this rank's, or that a peer failed). A rank
    whose own load succeeded while a peer's failed calls `undo` (a load in place puts the old
    weights back)."""
    value: T | None = None
    reason: str | None = None
    try:
        value = load(path)
    except Exception as exc:  # a failed load is reported and survived, never fatal
        reason = describe(exc)
        log.exception("weights.load_failed", path=path or "(configured model)", error=reason)
    if agree(reason is None, group, device):
        return value, None
    if reason is None and undo is not None:
        undo()
    del value  # free what this rank loaded: the group keeps its old weights
    return None, reason or "a peer rank could not load the weights (see its log)"


def check_weights(path: str, *, tp: int, ep: int = 1) -> str | None:
    """Why `path` cannot be served at `tp` x `ep` ranks (None when it looks servable); "" means the
    configured model, which was checked at start-up."""
    if not path:
        return None
    from consumer.checkpoints import check_teacher

    try:
        check_teacher(path, tp=tp, ep=ep)
    except Exception as exc:  # noqa: BLE001 - any refusal (bad JSON, missing file) is the reason
        return describe(exc)
    return None


class Reloader:
    """`reload(path)` for weight updates: a checkpoint of the model's shape is loaded in place
    (every parameter overwritten where it is, so CUDA graphs stay valid and nothing needs a
    warm-up); any other is built anew and warmed up (`build`, then `warm`).

    `path` "" means the configured model (`configured`, None for the tiny preset). A load in
    place that fails part-way puts the previous weights back before it raises; `undo` does the
    same after a load that succeeded here but failed on a peer rank (see `load_agreed`).

    FP8 checkpoints (`fp8`: the `model.fp8` setting): where their linears and MoE experts run
    in FP8, an update loads in place only when the new checkpoint holds the same linears and
    experts in FP8 with the same blocks (`hf.fp8_plan`); between an FP8-compute model and a
    bf16 checkpoint, or the other way, the model is rebuilt. Dequantized FP8 checkpoints load
    in place like any other."""

    def __init__(
        self,
        *,
        scorer: Any,
        path: str,
        configured: str | None,
        build: Callable[[str], tuple[Any, str]],
        warm: Callable[[Any], None],
        fp8: str = "auto",
    ) -> None:
        self.scorer = scorer
        self.fp8 = fp8
        self.path = path  # what the scorer serves now ("" = the configured model)
        self.configured = configured
        self.build = build
        self.warm = warm
        self.last_in_place = False
        self._previous: str | None = None  # set while `undo` can put the old weights back

    def _resolved(self, path: str) -> str | None:
        return path or self.configured

    def __call__(self, path: str) -> tuple[Any, str]:
        """Load `path` on this rank; returns the scorer (the same one when in place) and the
        model version."""
        self._previous = None
        version = self._in_place(path)
        if version is not None:
            self.last_in_place = True
            self._previous = self.path
        else:
            self.last_in_place = False
            scorer, version = self.build(path)
            self.warm(scorer)
            self.scorer = scorer
        self.path = path
        return self.scorer, version

    def undo(self) -> None:
        """Put back the weights served before the last call, if it loaded in place (a peer
        rank failed: every rank keeps its old weights)."""
        if self._previous is None:
            return
        previous, self._previous = self._previous, None
        self._restore(previous)
        self.path = previous

    def _in_place(self, path: str) -> str | None:
        """The new version after loading `path` into the current parameters, or None when it
        cannot be loaded in place (not a Hugging Face checkpoint, another shape)."""
        target = self._resolved(path)
        current = self.scorer
        if target is None:  # the tiny preset: random weights, built anew
            return None
        from consumer.checkpoints.hf import (
            HfCheckpoint,
            fp8_plan,
            load_hf_weights,
            validate_hf_checkpoint,
        )
        from consumer.checkpoints.teacher import checkpoint_kind, model_version

        if checkpoint_kind(target) != "hf":
            return None
        layout = current.layout
        device = next(current.model.parameters()).device
        with HfCheckpoint(target) as ckpt:
            spec = validate_hf_checkpoint(ckpt, tp=layout.tp, ep=layout.ep)
            if spec != current.spec:
                return None
            held = getattr(current.model, "teacherq_fp8_plan", None)
            if fp8_plan(ckpt, device, self.fp8) != held:
                return None  # FP8 linears would come or go: another model
            try:
                load_hf_weights(current.model, spec, ckpt, layout, fp8=self.fp8)
            except BaseException:
                self._restore(self.path)  # half-written parameters: the old weights back
                raise
        return model_version(target)

    def _restore(self, path: str) -> None:
        """Overwrite the current parameters with `path`'s weights (those served before)."""
        target = self._resolved(path)
        model = self.scorer.model
        try:
            if target is not None:
                from consumer.checkpoints.hf import load_hf_weights
                from consumer.checkpoints.teacher import checkpoint_kind

                if checkpoint_kind(target) == "hf":
                    load_hf_weights(
                        model, self.scorer.spec, target, self.scorer.layout, fp8=self.fp8
                    )
                    return
            old, _ = self.build(path)  # e.g. the tiny preset: built again, copied over
            with torch.no_grad():
                for dst, src in zip(model.parameters(), old.model.parameters(), strict=True):
                    dst.copy_(src)
        except Exception:
            log.exception("weights.restore_failed", path=path or "(configured model)")
            raise
