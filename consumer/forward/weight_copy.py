"""Host tensors into device parameters, the reading of the next overlapping the copy of this.

A checkpoint's tensors arrive on the host (read from safetensors memory maps); a plain
`param.copy_(host)` from pageable memory waits for each copy before the next tensor is read.
`ParamWriter` stages each tensor in one of two pinned buffers and copies it asynchronously, so
the device copy of one tensor runs while the host reads the next; it waits only before it
reuses a buffer. On the CPU it copies directly.
"""

from __future__ import annotations

import torch


class ParamWriter:
    """Writes host tensors into parameters of `device` (see the module doc); call `finish`
    before the parameters are read."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._device = device
        self._direct = False  # a copy went straight from pinned memory (`finish` waits)

    @torch.no_grad()
    def write(self, param: torch.Tensor, host: torch.Tensor) -> None:
        """Overwrite `param` with `host` (same shape; cast to the parameter's dtype)."""
        if not self.cuda or host.device.type != "cpu":
            param.copy_(host)
            return
        if host.is_pinned():  # staged already (`direct_read`); torch's host allocator keeps
            param.copy_(host, non_blocking=True)  # its block until this copy is done
            self._direct = True
            return
        i, self._next = self._next, self._next ^ 1
        event = self._events[i]
        if event is not None:  # the copy out of this buffer is still running
            event.synchronize()
        nbytes = host.numel() * host.element_size()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = buffer[:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)  # a view of the file's map: this is where its pages are read
        param.copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._events[i] = done

    def finish(self) -> None:
        """Wait for every copy queued, and release the staging buffers."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        if self._direct:
            torch.cuda.current_stream(self._device).synchronize()
        self._buffers = [None, None]
        self._events = [None, None]
