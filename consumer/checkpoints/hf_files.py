"""A Hugging Face safetensors directory read lazily: its config.json, every tensor's shape from
the file headers, and sliced reads of single tensors (a rank reads only its shard).

A leaf of the checkpoint package: the family-specific readers (`hf.py`, `hf_moe.py`,
`hf_mla.py`) all read through it, and it knows no family. An FP8 block-quantized checkpoint
(`hf_fp8.py`) is dequantized here, on the slice read, so no reader needs to know of it.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from consumer.checkpoints import hf_fp8
from consumer.checkpoints.validate import CheckpointError
from consumer.forward.weight_copy import Joined

_LAZY: ContextVar[bool] = ContextVar("teacherq_joined_lazily", default=False)

Shard = torch.Tensor | Joined
"""What a reader returns: a tensor, or (inside `joined_lazily`) a `Joined` of tensors."""

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"


class HfCheckpoint:
    """A Hugging Face safetensors directory: its config, tensor shapes, and sliced reads.

    Nothing but headers is read until `read` asks for (part of) a tensor.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"Hugging Face checkpoint directory not found: {self.path}")
        config_path = self.path / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(f"no {CONFIG_NAME} in {self.path}")
        self.config: dict = json.loads(config_path.read_text())
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, tuple[mmap.mmap, int, dict]] = {}
        self._file_of = self._locate_tensors()
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._dtypes: dict[str, str] = {}
        problems = hf_fp8.quantization_problems(self.config)
        if problems:
            raise CheckpointError(f"{config_path}: " + "; ".join(problems))
        self.fp8 = hf_fp8.fp8_format(self.config)
        """The FP8 block format when the checkpoint is quantized (else None)."""
        self.scales = hf_fp8.scales_of(self._file_of) if self.fp8 else {}
        """Quantized tensor name -> its `weight_scale_inv` tensor's name (FP8 checkpoints)."""

    def _locate_tensors(self) -> dict[str, Path]:
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map") or {}
            files = {name: self.path / file for name, file in weight_map.items()}
            gone = sorted({p.name for p in files.values() if not p.is_file()})
            if gone:
                raise CheckpointError(f"{INDEX_NAME} in {self.path} lists absent files: {gone}")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        found: dict[str, Path] = {}
        for shard in shards:
            for name in self._open(shard).keys():  # noqa: SIM118 - safe_open is not a dict
                if name in found:
                    raise CheckpointError(
                        f"tensor {name} is stored twice: in {found[name].name} and {shard.name}"
                    )
                found[name] = shard
        return found

    def _open(self, file: Path):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor stored (from the file headers only)."""
        if self._shapes is None:
            shapes = {}
            for name, file in self._file_of.items():
                handle = self._open(file)
                if name not in set(handle.keys()):
                    raise CheckpointError(
                        f"{INDEX_NAME} maps {name} to {file.name}, which lacks it"
                    )
                view = handle.get_slice(name)
                shapes[name] = tuple(view.get_shape())
                self._dtypes[name] = view.get_dtype()
            self._shapes = shapes
        return self._shapes

    @property
    def dtypes(self) -> dict[str, str]:
        """Name -> safetensors dtype name (`BF16`, `F8_E4M3`, ...) of every tensor stored."""
        _ = self.shapes
        return self._dtypes

    def read_slices(self, name: str, *slices: slice) -> torch.Tensor:
        """Tensor `name` sliced along its leading dimensions (e.g. experts, rows, columns);
        an FP8-quantized one dequantized (float32), reading only the scale blocks it touches."""
        scale = self.scales.get(name)
        if scale is not None and self.fp8 is not None:
            view = self._open(self._file_of[name]).get_slice(name)
            scale_view = self._open(self._file_of[scale]).get_slice(scale)
            return hf_fp8.read_dequantized(view, scale_view, slices, self.fp8)
        stored = self._stored(name)
        if stored is not None:
            return stored[slices]
        view = self._open(self._file_of[name]).get_slice(name)
        return view[slices] if slices else view[:]

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Tensor `name`, or only `rows` (dim 0) and/or `cols` (dim 1) of it (dequantized
        when FP8-quantized, like `read_slices`): a view of the file's memory map where it can
        be (copied once, straight into the parameter, by the loader), else a copy read by
        safetensors. Do not write into it."""
        if cols is not None:
            return self.read_slices(name, rows or slice(None), cols)
        if rows is not None:
            return self.read_slices(name, rows)
        return self.read_slices(name)

    def _stored(self, name: str) -> torch.Tensor | None:
        """Tensor `name` as a view of its file's memory map (no copy: pages are read when the
        view is), or None for a dtype torch cannot view (safetensors then reads it)."""
        mapped, base, header = self.mapping(self._file_of[name])
        info = header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in _VIEW_DTYPES:
            return None
        dtype = _VIEW_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        raw = torch.frombuffer(mapped, dtype=torch.uint8, offset=base + start, count=end - start)
        return raw.view(dtype).reshape(info["shape"])

    def byte_span(self, name: str, slices: Sequence[slice] = ()) -> tuple[Path, int, int]:
        """The file holding tensor `name`, and the bytes [start, end) of it that
        `name[slices]` lies within (leading dimensions sliced; a slice of columns spans the
        rows it cuts through)."""
        file = self._file_of[name]
        _, base, header = self.mapping(file)
        begin, end = (base + at for at in header[name]["data_offsets"])
        shape = self.shapes[name]
        ranges = hf_fp8.slice_ranges(shape, slices)
        if not shape or any(a >= b for a, b in ranges):
            return file, begin, begin
        itemsize = (end - begin) // math.prod(shape)
        first = _flat_index(shape, [a for a, _ in ranges])
        last = _flat_index(shape, [b - 1 for _, b in ranges])
        return file, begin + first * itemsize, begin + (last + 1) * itemsize

    def mapping(self, file: Path) -> tuple[mmap.mmap, int, dict]:
        """`file`'s private memory map (the one every view of its tensors is made from),
        where its data starts, and its header; mapped at the first call."""
        if file not in self._maps:
            self._maps[file] = _map_safetensors(file)
        return self._maps[file]

    def close(self) -> None:
        """Drop the open file handles and maps (a map lives on while a view of it does)."""
        self._handles.clear()
        self._maps.clear()

    def __enter__(self) -> HfCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_VIEW_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _map_safetensors(file: Path) -> tuple[mmap.mmap, int, dict]:
    """A private (copy-on-write, so torch may view it) memory map of a safetensors file, where
    its data starts, and its header."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return mapped, 8 + size, header


def _flat_index(shape: Sequence[int], index: Sequence[int]) -> int:
    """Row-major position of element `index` in a tensor of `shape`."""
    flat = 0
    for n, i in zip(shape, index, strict=True):
        flat = flat * n + i
    return flat


@contextmanager
def joined_lazily() -> Iterator[None]:
    """Inside, `cat` and `stack` return a `Joined` of their parts (copied into place by the
    loader's `ParamWriter`) instead of joining them on the host."""
    token = _LAZY.set(True)
    try:
        yield
    finally:
        _LAZY.reset(token)


def cat(parts: Sequence[Shard], dim: int = 0) -> Shard:
    """`torch.cat` for the loader's readers. Meta tensors (what a read plan's reads return:
    `parallel_read.PlanView`) are joined by their shapes alone: torch's own meta `cat` runs a
    Python reference that imports `torch._dynamo` on first use, 0.45 s of a CPU consumer's
    start on the development machine, for a plan's shapes. Under `joined_lazily`, a `Joined`."""
    first = parts[0]
    if _LAZY.get() and not first.is_meta:
        return Joined(list(parts), dim)
    if not first.is_meta:
        return torch.cat([p.tensor() if isinstance(p, Joined) else p for p in parts], dim)
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return torch.empty(shape, dtype=first.dtype, device="meta")


def stack(parts: Sequence[Shard], dim: int = 0) -> Shard:
    """`torch.stack` for the loader's readers: `cat` of the parts, each given the new
    dimension (a view, meta or not)."""
    return cat([p.unsqueeze(dim) for p in parts], dim)


Reader = Callable[[HfCheckpoint], Shard]
"""How to read one parameter's shard of a checkpoint (`hf.hf_shard_readers`' values)."""
