"""Pipeline-parallel scoring: a replica's layers split over pp stages, micro-batches in flight.

Every rank of the replica receives the whole batch (the leader broadcasts it as at pp = 1) and
packs it the same way. The packed rows are then cut into micro-batches at document boundaries
(never inside a document, nor between a shared prompt and the responses that attend to it), and
each stage runs its layers on micro-batch m as soon as it holds m's hidden states: stage 0
embeds and sends m to stage 1 and goes on with m + 1 while stage 1 works on m. With M
micro-batches and pp stages the forward takes M + pp - 1 steps instead of M * pp, so at
M >= pp + 1 no stage idles once the pipeline is full (`parallel.microbatches`).

Hidden states travel point to point between the ranks at the same position of consecutive
stages (every rank of a stage holds the full hidden states: no sequence parallelism). The last
stage gathers its micro-batches back into the packed batch and runs the head on its TP group,
exactly as `Scorer` does at pp = 1. Its first rank (`ParallelLayout.writer_rank`) then sends the
per-job result arrays to the leader, which stores them and acknowledges the entries as at
pp = 1: one rank talks to Redis and storage, so store-then-acknowledge keeps its single path.

Failures: a stage that fails on a micro-batch still sends (zeros) and receives everything the
schedule expects, so no peer waits on it; the error is raised when the batch finishes, where
the replica's agreement (consumer/group/agreement.py) fails the batch on every stage alike.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from consumer.forward.attention import TreeBounds, VarlenLayout
from consumer.forward.batch import BatchTensors
from consumer.forward.peers import peers_alive
from consumer.forward.prefix import PackedTree
from consumer.forward.scoring import PendingScore, Scorer
from shared.tracing import PhaseClock


def document_cuts(segments: tuple[tuple[int, int, int, int], ...]) -> list[int]:
    """Packed rows where a micro-batch may start: a segment's first row, when no segment from
    there on attends to context before it (a shared prompt stays with its responses)."""
    cuts, reach = [], None
    for start, _end, c0, c1 in reversed(segments):
        if c1 > c0:  # attends to rows c0 .. c1 - 1
            reach = c0 if reach is None else min(reach, c0)
        if reach is None or reach >= start:
            cuts.append(start)
    return sorted(cuts)


def split_rows(segments: tuple[tuple[int, int, int, int], ...], parts: int) -> list[range]:
    """Packed rows [0, P) cut into at most `parts` consecutive ranges of whole documents, as
    even in rows as the document boundaries allow (fewer when the batch has fewer units)."""
    total = segments[-1][1] if segments else 0
    cuts = [c for c in document_cuts(segments) if 0 < c < total]
    chosen: list[int] = []
    for i in range(1, parts):
        target = total * i / parts
        later = [c for c in cuts if not chosen or c > chosen[-1]]
        if not later:
            break
        best = min(later, key=lambda c: abs(c - target))
        chosen.append(best)
    bounds = [0, *chosen, total]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@dataclass(frozen=True)
class PipelineScorer(Scorer):
    """A `Scorer` for one pipeline stage; every rank of the replica calls the same steps."""

    microbatches: int = 0  # per batch; 0: pp + 1

    @property
    def _parts(self) -> int:
        return self.microbatches or self.layout.pp + 1

    @torch.inference_mode()
    def packed_hidden_states(
        self, tree: PackedTree, clock: PhaseClock | None = None
    ) -> torch.Tensor:
        """Run this stage's layers on every micro-batch, receiving from the previous stage and
        sending to the next. Returns the final hidden states [P, H] on the last stage and an
        empty tensor elsewhere; raises (after all the schedule's transfers) the first error a
        micro-batch met."""
        clock = clock or PhaseClock()
        layout, hidden = self.layout, self.spec.hidden_size
        dtype = next(self.model.parameters()).dtype
        parts = split_rows(tree.segments, self._parts)
        error: BaseException | None = None
        with clock.phase("h2d"):
            ids_P = tree.input_ids_P.to(self.device)
            pos_P = tree.position_P.to(self.device)
        with clock.phase("forward"):
            inbox = []
            if layout.prev_stage_rank is not None:  # every receive posted up front
                for m, rows in enumerate(parts):
                    buf = torch.empty((len(rows), hidden), dtype=dtype, device=self.device)
                    inbox.append((buf, _posted(dist.irecv(buf, src=layout.prev_stage_rank, tag=m))))
            sends, outs = [], []
            for m, rows in enumerate(parts):
                received = None
                if inbox:
                    received, request = inbox[m]
                    with peers_alive("receiving hidden states from the previous stage"):
                        request.wait()
                try:
                    out = self._stage_forward(tree, rows, ids_P, pos_P, received)
                except Exception as exc:  # noqa: BLE001 - raised after the transfers below
                    error = error or exc
                    out = torch.zeros((len(rows), hidden), dtype=dtype, device=self.device)
                if layout.next_stage_rank is not None:
                    out = out.contiguous()
                    sends.append((out, _posted(dist.isend(out, dst=layout.next_stage_rank, tag=m))))
                else:
                    outs.append(out)
            with peers_alive("sending hidden states to the next stage"):
                for _, request in sends:
                    request.wait()
        if error is not None:
            raise error
        if not outs:
            return torch.empty((0, hidden), dtype=dtype, device=self.device)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _stage_forward(
        self,
        tree: PackedTree,
        rows: range,
        ids_P: torch.Tensor,
        pos_P: torch.Tensor,
        received: torch.Tensor | None,
    ) -> torch.Tensor:
        """This stage's layers on the packed rows `rows` ([n, H] out)."""
        a, b = rows.start, rows.stop
        segments = tuple(
            (s - a, e - a, c0 - a, c1 - a) for s, e, c0, c1 in tree.segments if a <= s < b
        )
        position = pos_P[a:b]
        bounds = TreeBounds.from_segments(segments, max_position=int(tree.position_P[a:b].max()))
        if self.device.type == "cuda":
            bounds.varlen = VarlenLayout.of(segments, self.device)
        if received is not None:  # megatron's way in for a stage without the embedding
            self.model.set_input_tensor(received.view(b - a, 1, -1))
        out = self.model(
            ids_P[a:b][None], position[None], attention_mask=None, packed_seq_params=bounds
        )
        return out.reshape(b - a, -1)

    @torch.inference_mode()
    def launch(self, batch: BatchTensors, clock: PhaseClock | None = None) -> PipelinePending:
        """Run the pipelined forward (and, on the last stage, queue the head). Never raises:
        an error is kept for `result()`, after every transfer the peers expect."""
        clock = clock or PhaseClock()
        inner, error = None, None
        try:
            if self.layout.is_last_stage:
                inner = super().launch(batch, clock)
            else:
                self.packed_hidden_states(self.layout_of(batch), clock)
        except Exception as exc:  # noqa: BLE001 - raised by result(), after the transfers
            error = exc
        return PipelinePending(batch, clock, [], None, self, inner, error)


@dataclass(frozen=True)
class PipelinePending(PendingScore):
    """A batch launched on one stage; `result()` brings the last stage's outputs to the
    leader."""

    scorer: PipelineScorer
    inner: PendingScore | None  # the head's outputs, last stage only
    error: BaseException | None

    @torch.inference_mode()
    def result(self) -> list[dict[str, np.ndarray]]:
        """Every job's outputs on the leader (the writer's copy; [] on other ranks); raises
        this rank's error, or on the leader one saying the last stage failed."""
        layout, device = self.scorer.layout, self.scorer.device
        outputs: list[dict[str, np.ndarray]] = []
        error = self.error
        if self.inner is not None and error is None:
            try:
                outputs = self.inner.result()
            except Exception as exc:  # noqa: BLE001 - raised below, after the transfer
                error = exc
        if layout.rank == layout.writer_rank:
            with peers_alive("sending the outputs to the leader"):
                send_object(None if error else outputs, dst=layout.leader_rank, device=device)
            outputs = []
        elif layout.is_leader:
            with peers_alive("receiving the outputs of the last stage"):
                received = recv_object(src=layout.writer_rank, device=device)
            if error is None and received is None:
                error = RuntimeError("the last pipeline stage failed scoring the batch")
            outputs = received if isinstance(received, list) else []
        if error is not None:
            raise error
        return outputs


def _posted(work: dist.Work | None) -> dist.Work:
    """A point-to-point request (torch types it optional; a rank in the default group always
    gets one)."""
    assert work is not None
    return work


def send_object(obj: object, *, dst: int, device: torch.device) -> None:
    """Pickle `obj` to rank `dst` (its length, then its bytes)."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    dist.send(torch.tensor([data.size], dtype=torch.int64, device=device), dst=dst)
    dist.send(torch.from_numpy(data.copy()).to(device), dst=dst)


def recv_object(*, src: int, device: torch.device) -> object:
    """What `send_object` sent from rank `src`."""
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src=src)
    return pickle.loads(data.cpu().numpy().tobytes())  # a peer of this replica sent it
