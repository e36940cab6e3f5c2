"""The consumer's parallel layout: the only module that calls megatron.core.parallel_state.

A consumer process group of `world` ranks is split into data-parallel replicas of
`max(tp, ep) * pp` consecutive ranks each. Within a replica the leader (its first rank) is the
only rank that talks to Redis; it broadcasts each batch to its peers (the replica group).

With pipeline parallelism (pp > 1) a replica is pp stages of W = max(tp, ep) consecutive ranks
each (stage s: ranks leader + s * W .. leader + (s + 1) * W - 1); each stage holds a slice of the
layers, and hidden states travel point to point from a rank to the rank W above it (the same
position in the next stage). megatron-core sees every stage as a model of its own (its pipeline
degree stays 1): its TP groups are the same consecutive blocks of `tp` ranks.

Attention and the head run in tensor-parallel groups of `tp` consecutive ranks. A
mixture-of-experts teacher splits its experts `ep` ways over the replica's W = max(tp, ep)
ranks, each expert's FFN over W / ep of them (expert tensor parallelism); when ep > tp the
replica holds W / tp TP groups that compute attention on the same tokens. Dense teachers use
ep = 1, where the replica group is the TP group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


class LayoutError(ValueError):
    """The requested parallel layout cannot be formed; the message says why."""


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: global rank, its replica and its tensor-parallel group."""

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup | None
    leader_rank: int  # global rank of this replica's leader
    ep: int = 1  # expert-parallel degree (mixture-of-experts teachers)
    wide_group: dist.ProcessGroup | None = None  # the stage's ranks, only when ep > tp
    pipe_group: dist.ProcessGroup | None = None  # every rank of the replica, only when pp > 1

    @property
    def replica_size(self) -> int:
        """Ranks per pipeline stage (the whole replica at pp = 1): max(tp, ep)."""
        return max(self.tp, self.ep)

    @property
    def replica_rank(self) -> int:
        """This rank's index within its pipeline stage (within the replica at pp = 1; the
        leader is 0)."""
        return (self.rank - self.leader_rank) % self.replica_size

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline stage (the replica at pp = 1): experts split over
        them (None for a stage of one rank)."""
        return self.wide_group if self.ep > self.tp else self.tp_group

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """Every rank of this replica, all stages: batches, commands and agreement travel here
        (None for a replica of one rank)."""
        return self.pipe_group if self.pp > 1 else self.stage_group

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank embeds the tokens (pipeline stage 0)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the final norm and the head (the last pipeline stage)."""
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank this one receives hidden states from (None on the first stage)."""
        return None if self.is_first_stage else self.rank - self.replica_size

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank this one sends hidden states to (None on the last stage)."""
        return None if self.is_last_stage else self.rank + self.replica_size

    @property
    def writer_rank(self) -> int:
        """Global rank whose head outputs reach the leader: the last stage's first rank (the
        leader itself at pp = 1)."""
        return self.leader_rank + (self.pp - 1) * self.replica_size

    @property
    def is_leader(self) -> bool:
        """True on the one rank of the replica that reads from and writes to Redis."""
        return self.rank == self.leader_rank

    def describe(self) -> str:
        """Short human form, e.g. `tp2·pp1·dp1`."""
        ep = f"·ep{self.ep}" if self.ep > 1 else ""
        return f"tp{self.tp}{ep}·pp{self.pp}·dp{self.dp}"


def check_layout(*, world_size: int, tp: int, pp: int, ep: int = 1) -> int:
    """Validate degrees against the world size; return the data-parallel degree."""
    if tp < 1 or pp < 1 or ep < 1:
        raise LayoutError(f"parallel degrees must be >= 1, got tp={tp} pp={pp} ep={ep}")
    if max(tp, ep) % min(tp, ep):
        raise LayoutError(
            f"expert parallelism ep={ep} and tensor parallelism tp={tp}: the smaller must "
            "divide the larger (TEACHERQ_PARALLEL__EP, TEACHERQ_PARALLEL__TP)"
        )
    width = max(tp, ep)
    if world_size % (width * pp):
        what = f"tp*pp = {tp}*{pp}" if ep == 1 else f"max(tp, ep)*pp = {width}*{pp}"
        raise LayoutError(
            f"world size {world_size} is not a multiple of {what}; launch "
            f"a multiple of {width * pp} ranks (torchrun --nproc-per-node)"
        )
    return world_size // (width * pp)


def init_parallel(*, tp: int, pp: int, ep: int = 1, backend: str | None = None) -> ParallelLayout:
    """Join (or create) the process group from torchrun's environment and form TP groups.

    Without torchrun variables this process is a world of one on a free local port.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:  # launched by torchrun: its env:// rendezvous
            dist.init_process_group(backend=backend)
        else:  # a world of one; the environment stays untouched for child processes
            from shared.redis_server import free_port

            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
            )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    dp = check_layout(world_size=world_size, tp=tp, pp=pp, ep=ep)

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        # megatron sees each pipeline stage as a model of its own (see the module doc)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    leader = dist.get_global_rank(tp_group, 0) if tp > 1 else rank
    wide_group = None
    if ep > tp:  # replicas of ep consecutive ranks, each holding ep / tp TP groups
        for first in range(0, world_size, ep):  # every rank creates every group, in order
            group = dist.new_group(list(range(first, first + ep)))
            if first <= rank < first + ep:
                wide_group = group
        leader = rank - rank % ep
        dp_rank = rank // ep
    pipe_group = None
    if pp > 1:  # replicas of pp stages of max(tp, ep) consecutive ranks each
        span = max(tp, ep) * pp
        for first in range(0, world_size, span):  # every rank creates every group, in order
            group = dist.new_group(list(range(first, first + span)))
            if first <= rank < first + span:
                pipe_group = group
        leader = rank - rank % span
        pp_rank = (rank - leader) // max(tp, ep)
        dp_rank = rank // span
    return ParallelLayout(
        world_size=world_size,
        rank=rank,
        tp=tp,
        pp=pp,
        dp=dp,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        tp_group=tp_group if tp > 1 else None,
        leader_rank=leader,
        ep=ep,
        wide_group=wide_group,
        pipe_group=pipe_group,
    )


def shutdown() -> None:
    """Tear down megatron's groups and the process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
