"""Host tensors into device parameters, in pieces that stream through a few pinned buffers.

A checkpoint's tensors arrive on the host, read from safetensors memory maps; a parameter
made of several stored tensors comes as a `Joined` of them, each part copied into its place.
A plain `param.copy_(host)` from pageable memory waits for each copy before the next tensor
is read. `ParamWriter` copies each tensor in pieces of about `PIECE_BYTES` (whole rows of
its first dimension): a piece is copied into one of `BUFFERS` page-locked buffers and sent
to the device asynchronously, so the host copy of one piece runs while the device copies
the pieces before it; a buffer is waited for only before it is reused. After each piece it
tells `progress` (the read-ahead, which keeps its window that far ahead of the copy).

Pieces, not whole tensors: a MoE layer's experts are one tensor of many gigabytes (DeepSeek-V3:
15 GB of gate/up weights a layer). Staging such a tensor whole meant page-locking a buffer of
its size (the host allocator rounds it up to a power of two, and locking 16 GB takes seconds)
and a host copy that had to end before its device copy began: 17 s of a 51 GB DeepSeek-V3
cut's restart went to the copy (docs/benchmarks.md). Tensors already page-locked
(`direct_read`'s staging buffers) go to the device as they are. On the CPU it copies directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PIECE_BYTES = 64 << 20  # big enough for the copy engines' full rate, small to lock
BUFFERS = 4


class Joined:
    """Host tensors to be joined along `dim`, not yet copied into one: what the loader's
    readers return for a parameter made of several stored tensors (a layer's experts, gate and
    up, q, k and v). `ParamWriter` copies each part into its place in the parameter, so the
    joined tensor never exists on the host (for a DeepSeek-V3 layer's experts that was a 15 GB
    host copy before the copy to the device)."""

    is_meta = False

    def __init__(self, parts: list, dim: int) -> None:
        first = parts[0]
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.parts, self.dim = parts, dim
        self.shape, self.dtype = torch.Size(shape), first.dtype

    def unsqueeze(self, dim: int) -> Joined:
        """The parts given a new dimension `dim` (>= 0), as `torch.stack` needs."""
        if dim < 0:
            raise ValueError(f"Joined.unsqueeze takes a dimension >= 0, got {dim}")
        moved = self.dim + (1 if dim <= self.dim else 0)
        return Joined([p.unsqueeze(dim) for p in self.parts], moved)

    def tensor(self) -> torch.Tensor:
        """The joined tensor itself (a host copy)."""
        parts = [p.tensor() if isinstance(p, Joined) else p for p in self.parts]
        return torch.cat(parts, self.dim)


def row_pieces(rows: int, row_bytes: int, piece_bytes: int | None = None) -> list[slice]:
    """Slices of a tensor's first dimension (`rows` rows of `row_bytes` each) into pieces of
    at most `piece_bytes` (default PIECE_BYTES), or of one row where a row is larger."""
    step = max(1, (piece_bytes or PIECE_BYTES) // max(1, row_bytes))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


class ParamWriter:
    """Writes host tensors into parameters of `device` (see the module doc); call `finish`
    before the parameters are read."""

    def __init__(self, device: torch.device, progress: Callable[[int], None] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self._progress = progress  # told the bytes of each piece once it is read
        self._buffers: list[torch.Tensor | None] = [None] * BUFFERS
        self._events: list[torch.cuda.Event | None] = [None] * BUFFERS
        self._next = 0
        self._device = device
        self._direct = False  # a copy went straight from pinned memory (`finish` waits)

    @torch.no_grad()
    def write(self, param: torch.Tensor, host: torch.Tensor | Joined) -> None:
        """Overwrite `param` with `host` (same shape; cast to the parameter's dtype); a
        `Joined` part by part, each into its slice of `param`."""
        if isinstance(host, Joined):
            self._write_joined(param, host)
            return
        if not self.cuda or host.device.type != "cpu" or host.dim() == 0:
            param.copy_(host)
        elif host.is_pinned():  # staged already (`direct_read`); torch's host allocator keeps
            param.copy_(host, non_blocking=True)  # its block until this copy is done
            self._direct = True
        else:
            row_bytes = host[0].numel() * host.element_size()
            for rows in row_pieces(host.shape[0], row_bytes):
                self._send(param[rows], host[rows])
            return  # (`_send` told the progress)
        if self._progress is not None:
            self._progress(host.numel() * host.element_size())

    def _write_joined(self, param: torch.Tensor, host: Joined) -> None:
        """Each part into its slice of `param`. Parts joined along a later dimension than the
        first go row piece by row piece, every part's rows of a piece together: a fused
        [experts, gate | up, ...] tensor is then read in the order of its file (expert by
        expert, gate then up), which the read-ahead follows, not all gates before all ups."""
        dim, plain = host.dim, all(isinstance(p, torch.Tensor) for p in host.parts)
        if dim == 0 or not plain or not self.cuda:
            at = 0
            for part in host.parts:
                self.write(param.narrow(dim, at, part.shape[dim]), part)
                at += part.shape[dim]
            return
        row_bytes = sum(p[0].numel() for p in host.parts) * host.parts[0].element_size()
        for rows in row_pieces(host.shape[0], row_bytes):
            at = 0
            for part in host.parts:
                self.write(param[rows].narrow(dim, at, part.shape[dim]), part[rows])
                at += part.shape[dim]

    def _send(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Stage `src` in the next buffer (after its last copy is done) and queue its copy
        into `dst`."""
        i, self._next = self._next, (self._next + 1) % BUFFERS
        event = self._events[i]
        if event is not None:  # the copy out of this buffer is still running
            event.synchronize()
        nbytes = src.numel() * src.element_size()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, PIECE_BYTES)
            buffer = self._buffers[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        staged = buffer[:nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)  # from the file's map: this is where its pages are read
        dst.copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._events[i] = done
        if self._progress is not None:
            self._progress(nbytes)

    def finish(self) -> None:
        """Wait for every copy queued, and release the staging buffers."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        if self._direct:
            torch.cuda.current_stream(self._device).synchronize()
        self._buffers = [None] * BUFFERS
        self._events = [None] * BUFFERS
