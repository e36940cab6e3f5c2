"""CUDA graphs of the teacher's forward, replayed for batches of new lengths too.

A prefill forward launches hundreds of small kernels from Python (megatron's layers), which
for a small model can leave the GPU waiting on the host. A CUDA graph records the forward's
kernels once and replays them with a single launch, which also leaves the host (and the GIL)
free for finishing the previous batch and packing the next (docs/benchmarks.md, runs 2 and 8).

A graph is only valid for the shapes it recorded. Two ways to key them:

- **Buckets** (16-bit CUDA, where attention is one varlen flash call per layer; the consumer's
  default there). A batch is padded to a bucket: its token count rounded up (to 1/64 of its
  power of two: 256 rows for 8k-16k tokens), one padding document filling the rows added, its
  segment count rounded up to a power of two with empty segments, and the longest segment's
  query count rounded up to a power of two (flash attention sizes its grid by it; the key
  count it is given is the bucket's, an upper bound; neither changes the real rows' results).
  The cumulative lengths, key rows, ids and positions are inputs copied in before each replay,
  so one graph serves every batch of its bucket whatever its documents' lengths: traffic whose
  lengths never repeat still replays.
  The padding costs device time (about 1 % on average at 16k tokens a batch); the host queues a
  forward in well under a millisecond instead of tens of them. A batch holding a segment
  longer than 8192 tokens runs eagerly: its attention keeps the device busy far longer than
  the host needs to launch it, and such lengths would only add buckets.
- **Exact layouts** (elsewhere: fp32 on CUDA, where attention is one SDPA call per run of equal
  lengths). A graph holds one packed layout (the segments of `TreeBounds`); a layout runs
  eagerly the first time and is recorded when it comes again (a trainer sending batches of one
  shape).

A bucket is recorded the first time it comes (buckets recur), an exact layout the second
time (most never do), and the most recently used `max_graphs` are kept. All graphs share one
memory pool, so their activations take the memory of one forward, not one per graph; bucketed
graphs also write one shared output buffer. Recording costs no extra forward: the first
batch recorded runs eagerly first (as capture requires) and keeps that run's result; later
ones replay the graph just recorded (`record` records without running: the warm-up's).
The host records while the device computes what was queued before (no device sync, no cache
emptying, unlike `torch.cuda.graph`). Once `max_graphs` are held, a bucketed graph is
replaced only while captures stay under one in eight replays, so traffic spread over more
buckets than that runs the rest eagerly instead of recording all the time.

A graph reads the model's weights and rotary table at fixed addresses: moving the model
(sleep offloads it to the host) invalidates every graph, so `clear` must run before.
Graphs are used on CUDA at TP = 1 only; collectives inside a graph (TP > 1 over NCCL) are not
tested here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from consumer.forward.attention import TreeBounds, VarlenLayout, segment_arrays
from consumer.tp_ops import to_device

log = structlog.get_logger("teacherq.consumer")

Segments = tuple[tuple[int, int, int, int], ...]
Layout = tuple  # (segments, max_position) exactly, or ("bucket", *Bucket.key)
SEEN_LAYOUTS = 4096  # layouts remembered for their sightings (most recent), graphed or not
MIN_SEGMENTS = 16  # bucketed segment counts start here (then powers of two)
MIN_SPAN = 128  # bucketed longest-segment query counts start here (flash's row block)
MAX_GRAPHED_SPAN = 8192  # batches with a longer segment run eagerly (see the module doc)
REPLAYS_PER_CAPTURE = 8  # once full, at most one bucketed capture per this many replays


def bucket_rows(n: int) -> int:
    """`n` rows rounded up to a step of 1/64 of the power of two above it (at least 128):
    256-row steps for 8k-16k rows, so padding adds at most ~3 %, ~1 % on average."""
    step = max(MIN_SPAN, 1 << max(n.bit_length() - 6, 0))
    return -(-n // step) * step


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


@dataclass(frozen=True)
class Bucket:
    """A packed batch padded to its bucket (see the module doc): host arrays to copy into a
    bucketed graph's inputs, and the key of the graph that serves it."""

    tokens: int  # padded rows
    segments: Segments  # the batch's segments, then the padding document (if rows were added)
    cu_q: np.ndarray  # int32 [segment slots + 1]; empty segments repeat the last value
    cu_k: np.ndarray
    kv_rows: np.ndarray | None  # int64 [key slots], or None: every segment's keys are its rows
    max_q: int  # the longest segment's query count, rounded up
    max_k: int  # the key slots: at least any segment's key count

    @property
    def key(self) -> tuple[int, ...]:
        return (self.tokens, len(self.cu_q) - 1, self.max_q, self.max_k)

    @classmethod
    def of(cls, segments: Segments) -> Bucket:
        rows = segments[-1][1]
        tokens = bucket_rows(rows)
        if tokens > rows:  # the padding: one document of its own, attending only to itself
            segments = (*segments, (rows, tokens, rows, rows))
        a = segment_arrays(segments)
        slots = _pow2(len(segments), MIN_SEGMENTS)
        cu_q = np.full(slots + 1, a.cu_q[-1], dtype=np.int32)
        cu_k = np.full(slots + 1, a.cu_k[-1], dtype=np.int32)
        cu_q[: len(a.cu_q)], cu_k[: len(a.cu_k)] = a.cu_q, a.cu_k
        kv_rows = None
        if a.kv_rows is not None:  # keys past the last segment's are read by no query
            kv_rows = np.zeros(_pow2(len(a.kv_rows), tokens), dtype=np.int64)
            kv_rows[: len(a.kv_rows)] = a.kv_rows
        return cls(
            tokens=tokens,
            segments=segments,
            cu_q=cu_q,
            cu_k=cu_k,
            kv_rows=kv_rows,
            max_q=_pow2(int(a.q_len.max()), MIN_SPAN),
            max_k=tokens if kv_rows is None else len(kv_rows),
        )


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
    # cumulative lengths, key rows) at their addresses, so they live as long as the graph;
    # a bucketed graph's are overwritten before each replay.
    bounds: TreeBounds


class GraphedForward:
    """The model's packed forward through CUDA graphs: one per bucket (`buckets`, for varlen
    attention) or one per recurring exact layout."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_graphs: int,
        min_sightings: int | None = None,
        buckets: bool = False,
        max_rows: int = 0,
    ):
        self.model = model
        self.max_graphs = max_graphs
        # Sightings before a key is recorded: buckets recur, exact layouts mostly never do.
        self.min_sightings = min_sightings or (1 if buckets else 2)
        self.buckets = buckets
        self.enabled = max_graphs > 0
        self._graphs: OrderedDict[Layout, _Graph] = OrderedDict()
        self._seen: OrderedDict[Layout, int] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self._out: torch.Tensor | None = None  # bucketed graphs' shared output [rows, H]
        # Rows the shared output is first made for (the consumer's token budget): a larger
        # bucket later grows it, and every graph writing the old one must go.
        self.max_rows = bucket_rows(max_rows) if max_rows else 0
        self._side: torch.cuda.Stream | None = None  # where graphs are captured
        self._warm = False  # whether a capture ran (lazy library state exists): see _capture
        self.replays = 0
        self.captures = 0

    def __call__(
        self, ids_P: torch.Tensor, position_P: torch.Tensor, bounds: TreeBounds
    ) -> torch.Tensor:
        """Hidden states [P, H]. From a replay this is a graph's output buffer, valid until
        the next call (copy it to keep it)."""
        found = self._key(bounds)
        if found is None:
            return eager_forward(self.model, ids_P, position_P, bounds)
        key, bucket = found
        graph = self._graphs.get(key) if self.enabled else None
        if graph is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            self._seen.move_to_end(key)
            if len(self._seen) > SEEN_LAYOUTS:  # batches of ever new layouts: forget the oldest
                self._seen.popitem(last=False)
            if not self.enabled or seen < self.min_sightings or not self._room(bucket):
                return eager_forward(self.model, ids_P, position_P, bounds)
            # Recorded now; this batch's own result is the eager run that precedes capture.
            return self._capture(key, ids_P, position_P, bounds, bucket)
        self._graphs.move_to_end(key)
        rows = ids_P.shape[0]
        graph.ids_P[:rows].copy_(ids_P, non_blocking=True)
        graph.position_P[:rows].copy_(position_P, non_blocking=True)
        if bucket is not None:
            _copy_layout(graph.bounds.varlen, bucket)
        graph.graph.replay()
        self.replays += 1
        return graph.hidden_PH[:rows]

    def record(self, ids_P: torch.Tensor, position_P: torch.Tensor, bounds: TreeBounds) -> bool:
        """Record the graph that would serve this batch, without running the batch: the
        warm-up's full batches of each length class need only their recording, and replaying
        each (a whole forward of the token budget) was most of a large teacher's warm-up.
        The first capture still runs the batch eagerly, as capture requires. Returns whether
        a graph was recorded (not where graphs are off, the batch would run eagerly, its
        graph exists, or there is no room)."""
        found = self._key(bounds)
        if not self.enabled or found is None or found[0] in self._graphs:
            return False
        key, bucket = found
        if not self._room(bucket):
            return False
        captures = self.captures
        self._capture(key, ids_P, position_P, bounds, bucket, replay=False)
        return self.captures > captures

    def _key(self, bounds: TreeBounds) -> tuple[Layout, Bucket | None] | None:
        """The graph key of a batch laid out as `bounds`, and its bucket where bucketed;
        None where the batch runs eagerly (a segment longer than `MAX_GRAPHED_SPAN`)."""
        bucket = None
        if self.buckets and bounds.varlen is not None:
            bucket = Bucket.of(bounds.segments)
            if bucket.max_q > MAX_GRAPHED_SPAN:
                return None
        key: Layout = (
            ("bucket", *bucket.key) if bucket else (bounds.segments, int(bounds.max_seqlen_q))
        )
        return key, bucket

    def clear(self) -> None:
        """Drop every graph (their memory returns to the allocator) once queued replays are
        done; the next capture runs eagerly first again."""
        torch.cuda.synchronize()
        self._graphs.clear()
        self._out = None
        self._warm = False

    @property
    def size(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def _room(self, bucket: Bucket | None) -> bool:
        """Whether a new graph may be recorded now: always below `max_graphs`; once full,
        exact layouts replace the least recently used, buckets only while captures stay
        rarer than one per `REPLAYS_PER_CAPTURE` replays (no recording on every batch)."""
        if bucket is None or len(self._graphs) < self.max_graphs:
            return True
        return self.captures < self.max_graphs + self.replays // REPLAYS_PER_CAPTURE

    def _capture(
        self,
        key: Layout,
        ids_P: torch.Tensor,
        position_P: torch.Tensor,
        bounds: TreeBounds,
        bucket: Bucket | None,
        *,
        replay: bool = True,
    ) -> torch.Tensor:
        """Record a graph for `key` and return this batch's hidden states [P, H] (eager from
        here on if capture fails); with `replay` False (`record`) a capture that needed no
        eager run returns the output buffer unwritten.

        The first capture (and the first after `clear`) runs the batch eagerly first, on the
        stream it will capture on, as capture requires: whatever libraries initialise lazily
        (workspaces, loaded kernels) is then not recorded, and that run is the batch's result.
        Later captures skip it and replay the new graph instead: recording then costs the host
        about one eager forward's launches, not two."""
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        rows = ids_P.shape[0]
        if bucket is not None:  # the padded batch: ids and positions of padding are 0
            static_ids = ids_P.new_zeros(bucket.tokens)
            static_pos = position_P.new_zeros(bucket.tokens)
            static_ids[:rows], static_pos[:rows] = ids_P, position_P
            recorded = _bucket_bounds(bucket, int(bounds.max_seqlen_q) - 1, ids_P.device)
        else:
            static_ids, static_pos = ids_P.clone(), position_P.clone()
            recorded = bounds
        current = torch.cuda.current_stream()
        if self._side is None:
            self._side = torch.cuda.Stream()
        side = self._side
        side.wait_stream(current)
        warm = None
        if not self._warm:
            with torch.cuda.stream(side):
                warm = eager_forward(self.model, static_ids, static_pos, recorded)
            current.wait_stream(side)
            warm.record_stream(current)
        try:
            out = self._output(bucket.tokens, warm) if bucket is not None else None
            if not self._graphs:
                # A pool dies with the last graph that used it: capturing into it again trips
                # an internal assert of torch's allocator (seen with torch 2.11), so start anew.
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # capture_begin / capture_end directly: torch.cuda.graph would also synchronize
            # the device and empty the caches, stalling the batches queued before this one.
            # thread_local: the consumer's other threads may touch CUDA meanwhile.
            with torch.cuda.stream(side):
                graph.capture_begin(self._pool, capture_error_mode="thread_local")
                try:
                    hidden = eager_forward(self.model, static_ids, static_pos, recorded)
                    if out is not None:  # into the shared buffer: the pool keeps no output each
                        out.copy_(hidden)
                        hidden = out
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager forwards for good
            self.enabled = False
            self._graphs.clear()
            self._out = None
            log.warning("cuda_graphs.disabled", error=f"{type(exc).__name__}: {exc}")
            if warm is None:
                return eager_forward(self.model, ids_P, position_P, bounds)
            return warm[:rows]
        self.captures += 1
        self._warm = True
        log.info(
            "cuda_graphs.captured",
            tokens=int(static_ids.shape[0]),
            segments=len(recorded.segments),
            bucketed=bucket is not None,
            graphs=len(self._graphs) + 1,
            warm_up=warm is not None,
        )
        self._graphs[key] = _Graph(graph, static_ids, static_pos, hidden, recorded)
        if warm is not None:
            return warm[:rows]
        if not replay:
            return hidden[:rows]
        graph.replay()  # on the current stream, after what was queued before this batch
        self.replays += 1
        return hidden[:rows]

    def _output(self, rows: int, like: torch.Tensor | None) -> torch.Tensor:
        """The first `rows` rows of the shared output buffer, made like `like` (a forward's
        hidden states) or the buffer before; a larger bucket than any before grows it, and the
        graphs writing the old one go."""
        if self._out is None or self._out.shape[0] < rows:
            old = self._out
            like = like if like is not None else old
            assert like is not None  # the first capture after a clear runs eagerly first
            if self._graphs:  # their replays may still be queued: let them finish first
                torch.cuda.synchronize()
                self._graphs.clear()
            size = max(rows, self.max_rows, 2 * (0 if old is None else old.shape[0]))
            self._out = like.new_empty((size, *like.shape[1:]))
        return self._out[:rows]


def _bucket_bounds(bucket: Bucket, max_position: int, device: torch.device) -> TreeBounds:
    """TreeBounds of a padded batch whose varlen layout lives in device tensors of its own
    (a bucketed graph's inputs), copied there through pinned memory: a plain `.to` would wait
    for every batch queued on the device before the recording could start."""
    bounds = TreeBounds.from_segments(bucket.segments, max_position=max_position)
    bounds.varlen = VarlenLayout(
        cu_q=to_device(torch.from_numpy(bucket.cu_q), device),
        cu_k=to_device(torch.from_numpy(bucket.cu_k), device),
        max_q=bucket.max_q,
        max_k=bucket.max_k,
        kv_rows=None
        if bucket.kv_rows is None
        else to_device(torch.from_numpy(bucket.kv_rows), device),
    )
    return bounds


def _copy_layout(layout: VarlenLayout | None, bucket: Bucket) -> None:
    """A batch's padded varlen layout into a bucketed graph's inputs, through pinned memory
    (no wait for the device)."""
    assert layout is not None  # bucketed graphs record one
    pairs = [(layout.cu_q, bucket.cu_q), (layout.cu_k, bucket.cu_k)]
    if bucket.kv_rows is not None:
        assert layout.kv_rows is not None
        pairs.append((layout.kv_rows, bucket.kv_rows))
    for dst, src in pairs:
        dst.copy_(torch.from_numpy(src).pin_memory(), non_blocking=True)
