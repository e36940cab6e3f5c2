"""What the parts of one replica's leader share: the model it serves and its running totals."""

from __future__ import annotations

from dataclasses import dataclass

from consumer.forward.scoring import Scorer


@dataclass
class LoadedModel:
    """The model this replica serves now; a weight update (consumer/serve/control.py) replaces all
    three together, and every part reads them from here at use."""

    scorer: Scorer
    version: str
    generation: int = 0
    path: str = ""  # the checkpoint served ("": the built-in tiny preset), in heartbeats


@dataclass
class Counters:
    """Running totals reported in heartbeats and logs."""

    jobs_done: int = 0
    jobs_failed: int = 0
    duplicates_skipped: int = 0
    tokens: int = 0
    batches: int = 0
    busy_s: float = 0.0  # time the group spent scoring
    idle_s: float = 0.0  # time with work at hand but no batch in flight (Leader._count_idle)
    prefix_tokens_saved: int = 0  # tokens not computed thanks to shared prompts

    @property
    def idle_fraction(self) -> float:
        """Share of working time the device was not computing although work was at hand."""
        total = self.busy_s + self.idle_s
        return round(self.idle_s / total, 4) if total else 0.0
