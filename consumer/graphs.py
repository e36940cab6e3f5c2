"""CUDA graphs of the teacher's forward, replayed for batch layouts seen before.

A prefill forward launches hundreds of small kernels from Python (megatron's layers), which
for a small model can leave the GPU waiting on the host. A CUDA graph records the forward's
kernels once and replays them with a single launch, which also leaves the host (and the GIL)
free for the result writers (measured gains: docs/benchmarks.md, run 2).

A graph is only valid for the exact shapes it recorded: one packed layout (the segments of
`TreeBounds`, which fix the token count and the attention calls). `GraphedForward` therefore
runs a layout eagerly the first time, records it when it comes again (usual: a trainer sends
batches of one shape), and keeps the most recently used `max_graphs` graphs. All graphs share
one memory pool, so their activations take the memory of one forward, not one per graph; each
keeps its own input and output buffers.

A graph reads the model's weights and rotary table at fixed addresses: moving the model
(sleep offloads it to the host) invalidates every graph, so `clear` must run before.
Graphs are used on CUDA at TP = 1 only; collectives inside a graph (TP > 1 over NCCL) are not
tested here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

from consumer.attention import TreeBounds

log = structlog.get_logger("teacherq.consumer")

Layout = tuple[tuple[tuple[int, int, int, int], ...], int]  # (segments, max_position)
SEEN_LAYOUTS = 4096  # layouts remembered for their sightings (most recent), graphed or not


def eager_forward(
    model: torch.nn.Module, ids_P: torch.Tensor, position_P: torch.Tensor, bounds: TreeBounds
) -> torch.Tensor:
    """Final hidden states [P, H] of a packed batch."""
    hidden = model(ids_P[None], position_P[None], attention_mask=None, packed_seq_params=bounds)
    return hidden.reshape(ids_P.shape[0], -1)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids_P: torch.Tensor  # the recorded inputs: copy a batch in, then replay
    position_P: torch.Tensor
    hidden_PH: torch.Tensor  # the recorded output, overwritten by every replay
    # The recorded layout: the graph reads its device tensors (the varlen attention's
    # cumulative lengths) at their addresses, so they live as long as the graph.
    bounds: TreeBounds


class GraphedForward:
    """The model's packed forward through CUDA graphs, one per recurring layout."""

    def __init__(self, model: torch.nn.Module, *, max_graphs: int, min_sightings: int = 2):
        self.model = model
        self.max_graphs = max_graphs
        self.min_sightings = min_sightings
        self.enabled = max_graphs > 0
        self._graphs: OrderedDict[Layout, _Graph] = OrderedDict()
        self._seen: OrderedDict[Layout, int] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.replays = 0
        self.captures = 0

    def __call__(
        self, ids_P: torch.Tensor, position_P: torch.Tensor, bounds: TreeBounds
    ) -> torch.Tensor:
        """Hidden states [P, H]. From a replay this is the graph's output buffer, valid until
        the next call (copy it to keep it)."""
        key: Layout = (bounds.segments, int(bounds.max_seqlen_q))
        graph = self._graphs.get(key) if self.enabled else None
        if graph is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            self._seen.move_to_end(key)
            if len(self._seen) > SEEN_LAYOUTS:  # batches of ever new layouts: forget the oldest
                self._seen.popitem(last=False)
            if not self.enabled or seen < self.min_sightings:
                return eager_forward(self.model, ids_P, position_P, bounds)
            graph = self._capture(key, ids_P, position_P, bounds)
            if graph is None:
                return eager_forward(self.model, ids_P, position_P, bounds)
        self._graphs.move_to_end(key)
        graph.ids_P.copy_(ids_P, non_blocking=True)
        graph.position_P.copy_(position_P, non_blocking=True)
        graph.graph.replay()
        self.replays += 1
        return graph.hidden_PH

    def clear(self) -> None:
        """Drop every graph (their memory returns to the allocator)."""
        self._graphs.clear()
        torch.cuda.synchronize()

    @property
    def size(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def _capture(
        self, key: Layout, ids_P: torch.Tensor, position_P: torch.Tensor, bounds: TreeBounds
    ) -> _Graph | None:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        if not self._graphs:
            # A pool dies with the last graph that used it: capturing into it again trips
            # an internal assert of torch's allocator (seen with torch 2.11), so start anew.
            self._pool = torch.cuda.graph_pool_handle()
        static_ids, static_pos = ids_P.clone(), position_P.clone()
        try:
            # One eager run on a side stream first, as CUDA graph capture requires: whatever
            # is initialised lazily (library workspaces) is then not recorded.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eager_forward(self.model, static_ids, static_pos, bounds)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = eager_forward(self.model, static_ids, static_pos, bounds)
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager forwards for good
            self.enabled = False
            self._graphs.clear()
            log.warning("cuda_graphs.disabled", error=f"{type(exc).__name__}: {exc}")
            return None
        self.captures += 1
        log.info(
            "cuda_graphs.captured",
            tokens=int(ids_P.shape[0]),
            segments=len(bounds.segments),
            graphs=len(self._graphs) + 1,
        )
        entry = _Graph(graph, static_ids, static_pos, hidden, bounds)
        self._graphs[key] = entry
        return entry
