"""One micro-batch as tensors: what every rank of a tensor-parallel group computes on.

The forward room owns the batch's shape; the group room (consumer/group/batching.py) builds it
from decoded jobs and moves it between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from consumer.forward.prefix import PackedTree, pack_tree


@dataclass
class BatchTensors:
    """One micro-batch as tensors; identical on every rank of a TP group.

    J jobs, T tokens in total, R = T - J scored rows (every position but each job's last).
    """

    input_ids_T: torch.Tensor  # int64 [T], documents back to back
    lengths_J: torch.Tensor  # int64 [J]
    label_width_J: torch.Tensor  # int64 [J]
    labels_RW: torch.Tensor  # int64 [R, Wmax], zero-padded past each job's width
    # One column per request option (OPTION_COLUMNS), in RequestOptions order.
    sample_n_J: torch.Tensor  # int64 [J]
    top_k_J: torch.Tensor  # int64 [J]
    return_entropy_J: torch.Tensor  # int64 [J] (0/1)
    temperature_J: torch.Tensor  # float64 [J]
    seed_J: torch.Tensor  # int64 [J]
    group_J: torch.Tensor  # int64 [J], jobs sharing a prompt share an id >= 0; -1 alone
    prefix_len_J: torch.Tensor  # int64 [J], tokens of the shared prompt (0 alone)

    @property
    def num_jobs(self) -> int:
        """J."""
        return int(self.lengths_J.shape[0])

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.input_ids_T.shape[0])

    @cached_property
    def packed(self) -> PackedTree:
        """The packed layout of the batch (`consumer.forward.prefix.pack_tree`), computed once: the
        checks and the launch both need it (raises ValueError if prompt sharing is
        inconsistent)."""
        return pack_tree(self.input_ids_T, self.lengths_J, self.group_J, self.prefix_len_J)

    @property
    def prefix_tokens_saved(self) -> int:
        """Forward tokens this batch does not compute because shared prompts run once."""
        saved = 0
        for g in torch.unique(self.group_J[self.group_J >= 0]).tolist():
            members = self.prefix_len_J[self.group_J == g]
            saved += int(members.sum() - members[0])
        return saved
