"""Checkpoint bytes read straight into staging buffers (consumer/checkpoints/direct_read.py):
every reader reads through a group's view exactly what it reads from the memory map, the
tensors it takes whole or by leading slices come out of the staging buffer (not the map), the
window bounds what is staged, a group whose read fails is read from the map, and a load takes
the stage only for a checkpoint the page cache does not hold."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from consumer.checkpoints import HfCheckpoint, spec_from_hf_config
from consumer.checkpoints.direct_read import DirectStage, choose
from consumer.checkpoints.hf import hf_shard_readers, load_hf_weights
from consumer.checkpoints.page_cache import cached_share, evict
from consumer.checkpoints.parallel_read import Span, read_plan
from consumer.forward.model import build_model
from tests.helpers import evict_every_page, unreclaimed
from tests.timing import wait_until
from tests.unit.test_parallel_read import MIB, PLAN_CASES, _groups, _layout, plan_case


def _inside(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= t.data_ptr() < start + buffer.numel()


@PLAN_CASES
def test_staged_reads_are_the_maps_and_come_from_the_buffer(
    hf_checkpoint, tmp_path, family, fp8, tp, ep, rank
):
    _, ckpt, readers, plan = plan_case(hf_checkpoint, tmp_path, family, fp8, tp, ep, rank)
    staged = 0
    # a chunk smaller than most tensors, so groups are read by several threads
    with DirectStage(ckpt, plan, pinned=False, threads=3, chunk=8192) as stage:
        for i, (name, read) in enumerate(readers.items()):
            view = stage.view(i)
            got = read(view)
            assert torch.equal(got, read(ckpt)), name
            buffer = stage._groups[i].buffer
            staged += buffer is not None and _inside(got, buffer)
            stage.advance(i)
    assert stage.direct, "ext4 takes O_DIRECT: the test must exercise it"
    # tensors read whole or by rows are views of the buffer; concatenations (fused QKV,
    # gate/up) and FP8 dequantization make new tensors
    assert staged >= len(readers) // 4, f"only {staged} of {len(readers)} reads were staged"


def test_a_load_through_the_stage_equals_the_maps(hf_checkpoint, layout):
    path = hf_checkpoint("qwen2", "read-plan-qwen2", seed=5, vocab_size=300)
    spec = spec_from_hf_config(HfCheckpoint(path).config)
    loaded = []
    for direct in (False, True):
        model = build_model(spec, layout)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        load_hf_weights(model, spec, path, layout, read_threads=2, read_direct=direct)
        loaded.append(dict(model.named_parameters()))
    for name, param in loaded[0].items():
        assert torch.equal(loaded[1][name], param), name


def test_staged_bytes_stay_inside_the_window(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * (10 * MIB // 256))
    ckpt_like = _FileOnly()
    stage = DirectStage(ckpt_like, _groups(data), pinned=False, threads=4, window=2 * MIB,
                        chunk=MIB // 4)  # fmt: skip
    with stage:
        wait_until(lambda: stage.bytes_read == 2 * MIB, "two groups staged")
        assert stage._outstanding == 2 * MIB and stage.bytes_read == 2 * MIB
        stage.view(0)
        stage.advance(0)  # the loader is done with group 0: room for one more
        wait_until(lambda: stage.bytes_read == 3 * MIB, "a third group staged")
        assert stage._outstanding == 2 * MIB
        buffer = stage._groups[1].buffer
        assert buffer is not None
        assert bytes(buffer[:256].tolist()) == bytes(range(256)), "the file's bytes, in place"


def test_a_group_larger_than_the_window_is_read_alone(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\x01" * (4 * MIB))
    plan = [[Span(data, 0, 3 * MIB)], [Span(data, 3 * MIB, 4 * MIB)]]
    with DirectStage(_FileOnly(), plan, pinned=False, threads=2, window=MIB, chunk=MIB) as stage:
        stage.view(0)
        assert stage._groups[0].left == 0 and stage.bytes_read >= 3 * MIB
        stage.advance(0)
        stage.view(1)
        assert stage.bytes_read == 4 * MIB


def test_a_group_whose_read_fails_is_read_from_the_map(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\x02" * MIB)
    plan = [[Span(tmp_path / "gone.bin", 0, MIB)], [Span(data, 0, MIB)]]
    with DirectStage(_FileOnly(), plan, pinned=False, threads=1, chunk=MIB) as stage:
        assert stage.view(0)._group is None, "the failed group falls back to the map"
        stage.advance(0)
        assert stage.view(1)._group is not None
    assert stage.bytes_read == MIB


class _FileOnly(HfCheckpoint):
    """A stand-in checkpoint for stages over plain files (the views are not read)."""

    def __init__(self) -> None:
        self.path = Path("/nonexistent")


def test_the_page_cache_share_is_read_off_the_cache(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\x03" * (4 * MIB))
    spans = [(data, 0, 4 * MIB)]

    def read_cold(size: int) -> float | None:
        evict_every_page([data])  # (cached_share's probes would read what they miss)
        fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
        os.pread(fd, size, 0)
        os.close(fd)
        return cached_share(spans, samples=128)

    assert unreclaimed(lambda: read_cold(4 * MIB)) == 1.0
    assert 0.3 < (unreclaimed(lambda: read_cold(2 * MIB)) or 0) < 0.7, "half of it read back"


def test_a_cold_checkpoint_is_read_past_the_cache_where_measured(hf_checkpoint):
    path = hf_checkpoint("qwen2", "read-plan-qwen2", seed=5, vocab_size=300)
    ckpt = HfCheckpoint(path)
    readers = hf_shard_readers(spec_from_hf_config(ckpt.config), _layout(1, 0))
    plan = read_plan(ckpt, readers.values())
    files = sorted(Path(path).glob("*.safetensors"))
    evict(files)
    assert choose(plan, torch.device("cpu")), "cold, on a device where it was measured"
    assert not choose(plan, torch.device("cuda")), "not measured on a GPU yet"
    for file in files:
        file.read_bytes()
    assert not choose(plan, torch.device("cpu")), "warm: the cache is faster than the disk"
