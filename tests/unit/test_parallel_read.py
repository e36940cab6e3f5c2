"""Checkpoint reads ahead of the loader (consumer/checkpoints/parallel_read.py): the plan covers
every byte the readers read (a copy of the checkpoint garbled everywhere else loads the same
weights), and `ReadAhead` brings every planned page into the page cache (populating the
loader's map, or reading), stays inside its window and skips what the loader has passed."""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from consumer.checkpoints import HfCheckpoint, spec_from_hf_config
from consumer.checkpoints.hf import hf_shard_readers
from consumer.checkpoints.page_cache import evict
from consumer.checkpoints.parallel_read import PlanView, ReadAhead, Span, read_plan
from consumer.parallel import ParallelLayout
from tests.fp8_reference import write_fp8_pair
from tests.helpers import cached_pages, evict_every_page, unreclaimed
from tests.timing import wait_until

MOE = {"num_layers": 2, "num_experts": 4, "top_k": 2, "moe_intermediate_size": 32}
FAMILIES = {
    "qwen2": {},
    "qwen3_moe": MOE,
    "deepseek_v3": {**MOE, "first_k_dense_replace": 1, "num_kv_heads": 4},
}


def _layout(tp: int, rank: int, ep: int = 1) -> ParallelLayout:
    size = max(tp, ep)
    return ParallelLayout(
        world_size=size, rank=rank, tp=tp, pp=1, dp=1, tp_rank=rank % tp, pp_rank=0, dp_rank=0,
        tp_group=None, leader_rank=0, ep=ep,
    )  # fmt: skip


def _garbled_outside(plan: list[list[Span]], src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` whose tensor bytes outside `plan`'s spans are all 0xFF (NaN
    in every float dtype), its headers and config kept."""
    shutil.copytree(src, dst)
    planned: dict[str, list[Span]] = {}
    for spans in plan:
        for span in spans:
            planned.setdefault(span.path.name, []).append(span)
    for file in dst.glob("*.safetensors"):
        data = bytearray(file.read_bytes())
        (header,) = struct.unpack("<Q", data[:8])
        keep = bytearray(data)
        data[8 + header :] = b"\xff" * (len(data) - 8 - header)
        for span in planned.get(file.name, []):
            data[span.start : span.end] = keep[span.start : span.end]
        file.write_bytes(bytes(data))
    return dst


def _read_all(ckpt: HfCheckpoint, readers: dict) -> dict[str, torch.Tensor]:
    return {name: read(ckpt).clone() for name, read in readers.items()}


PLAN_CASES = pytest.mark.parametrize(
    "family, fp8, tp, ep, rank",
    [
        ("qwen2", False, 1, 1, 0),
        ("qwen2", False, 2, 1, 1),
        ("qwen3_moe", False, 2, 1, 1),
        ("qwen3_moe", False, 1, 2, 1),
        ("deepseek_v3", False, 2, 1, 0),
        ("deepseek_v3", True, 2, 1, 1),
    ],
)
"""Families, FP8 or not, and the rank of a split: every reader the loader has."""


def plan_case(hf_checkpoint, tmp_path: Path, family: str, fp8: bool, tp: int, ep: int,
              rank: int) -> tuple[Path, HfCheckpoint, dict, list[list[Span]]]:  # fmt: skip
    """A `PLAN_CASES` case's checkpoint, rank's readers and their read plan."""
    path = hf_checkpoint(family, f"read-plan-{family}", seed=5, vocab_size=300, **FAMILIES[family])
    if fp8:
        path, _ = write_fp8_pair(path, tmp_path / "fp8", [8, 8])
    ckpt = HfCheckpoint(path)
    readers = hf_shard_readers(spec_from_hf_config(ckpt.config), _layout(tp, rank, ep))
    return Path(path), ckpt, readers, read_plan(ckpt, readers.values())


@PLAN_CASES
def test_plan_covers_every_byte_the_readers_read(
    hf_checkpoint, tmp_path, family, fp8, tp, ep, rank
):
    path, ckpt, readers, plan = plan_case(hf_checkpoint, tmp_path, family, fp8, tp, ep, rank)
    assert len(plan) == len(readers) and all(plan), "every reader reads something"

    garbled = HfCheckpoint(_garbled_outside(plan, Path(path), tmp_path / "garbled"))
    expected, got = _read_all(ckpt, readers), _read_all(garbled, readers)
    for name in readers:
        assert torch.equal(got[name], expected[name]), f"{name} read bytes outside its plan"

    planned = sum(s.end - s.start for spans in plan for s in spans)
    stored = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    share = 0.8 if tp > 1 else 0.9 if ep > 1 else 1.0  # replicated parts (norms, MLA latents)
    assert planned <= share * stored, f"a rank plans its share: {planned} of {stored} bytes"


@PLAN_CASES
def test_a_plan_gives_every_reader_its_real_shape(
    hf_checkpoint, tmp_path, family, fp8, tp, ep, rank
):
    """Against the plan's meta reads, each reader returns the shape and dtype its real read
    has (the joins of q/k/v, gate/up and the experts follow meta tensors by shape)."""
    _, ckpt, readers, _ = plan_case(hf_checkpoint, tmp_path, family, fp8, tp, ep, rank)
    view = PlanView(ckpt)
    for name, read in readers.items():
        planned, real = read(view), read(ckpt)
        assert planned.is_meta, name
        assert (planned.shape, planned.dtype) == (real.shape, real.dtype), name


def test_planning_a_load_imports_no_compiler(hf_checkpoint, tmp_path):
    """Planning every `PLAN_CASES` load in a fresh interpreter set up as `python -m consumer`
    is does not import `torch._dynamo` (torch's meta cat would: seconds of a consumer's
    start, which nothing else of a load needs)."""
    cases = []
    for family, fp8, tp, ep, rank in PLAN_CASES.args[1]:
        path, *_ = plan_case(hf_checkpoint, tmp_path / family / str(fp8), family, fp8, tp, ep, rank)
        cases.append((str(path), tp, ep, rank))
    code = f"""
import sys
from consumer.serve.lazy_compile import deferred_torch_compile
with deferred_torch_compile():
    import consumer.serve.service
from consumer.checkpoints import HfCheckpoint, spec_from_hf_config
from consumer.checkpoints.hf import hf_shard_readers
from consumer.checkpoints.parallel_read import read_plan
from consumer.parallel import ParallelLayout
assert "torch._dynamo" not in sys.modules, "imported before planning"
for path, tp, ep, rank in {cases!r}:
    ckpt = HfCheckpoint(path)
    layout = ParallelLayout(world_size=max(tp, ep), rank=rank, tp=tp, pp=1, dp=1,
        tp_rank=rank % tp, pp_rank=0, dp_rank=0, tp_group=None, leader_rank=0, ep=ep)
    plan = read_plan(ckpt, hf_shard_readers(spec_from_hf_config(ckpt.config), layout).values())
    assert all(plan), path
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_garbling_outside_a_short_plan_is_caught(hf_checkpoint, tmp_path):
    """The check above can fail: a plan missing one reader's spans loads NaNs there."""
    path = hf_checkpoint("qwen2", "read-plan-qwen2", seed=5, vocab_size=300)
    ckpt = HfCheckpoint(path)
    readers = hf_shard_readers(spec_from_hf_config(ckpt.config), _layout(1, 0))
    plan = read_plan(ckpt, readers.values())
    names = list(readers)
    dropped = names.index("decoder.layers.0.mlp.linear_fc2.weight")
    plan[dropped] = []
    garbled = HfCheckpoint(_garbled_outside(plan, Path(path), tmp_path / "garbled"))
    assert torch.isnan(readers[names[dropped]](garbled)).all()


# ReadAhead on a plain file: groups of 1 MiB, read in chunks of 256 KiB.
MIB = 1 << 20


@pytest.fixture
def data_file(tmp_path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(10 * MIB))
    return path


def _groups(path: Path, n: int = 10) -> list[list[Span]]:
    return [[Span(path, i * MIB, (i + 1) * MIB)] for i in range(n)]


def _seen(ahead: ReadAhead) -> int:
    return ahead.bytes_read


@pytest.mark.parametrize("how", ["populate", "pread"])
def test_every_planned_page_is_brought_in(data_file, how):
    plan = _groups(data_file, 4) + [[Span(data_file, 6 * MIB + 3, 6 * MIB + 3 + MIB // 3)]]
    spans = [span for group in plan for span in group]
    total = 4 * MIB + MIB // 3

    def read_ahead_cold() -> list[int]:
        evict_every_page([data_file])
        with (
            open(data_file, "rb") as f,
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped,
        ):
            maps = {data_file: mapped} if how == "populate" else None
            with ReadAhead(plan, maps=maps, threads=3, window=64 * MIB, chunk=MIB // 4) as ahead:
                wait_until(lambda: _seen(ahead) == total, "the read-ahead to bring the plan in")
        assert _seen(ahead) == total and ahead.failed == 0
        return [cached_pages(data_file, span.start, span.end) for span in spans]

    pages = [len(range(s.start - s.start % mmap.PAGESIZE, s.end, mmap.PAGESIZE)) for s in spans]
    assert unreclaimed(read_ahead_cold) == pages


def test_populate_asks_the_kernel_about_the_maps_own_bytes(data_file):
    """`populate` hands libc the map's own address (through ctypes, which lets go of the GIL
    while the kernel reads; Python's `mmap.madvise` holds it), lets go of its view of the map
    (which can then be closed), and brings the range in."""
    import ctypes

    from consumer.checkpoints import page_cache

    evict([data_file])
    with open(data_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        address = page_cache._address(mapped)
        assert address is not None
        assert ctypes.string_at(address + 5 * MIB, 64) == mapped[5 * MIB : 5 * MIB + 64]
        assert page_cache.populate(mapped, 2 * MIB + 1, 3 * MIB)
        assert cached_pages(data_file, 2 * MIB, 3 * MIB) == MIB // mmap.PAGESIZE
        # past the file's end (a truncated checkpoint): what there is, as mmap.madvise would
        assert page_cache.populate(mapped, len(mapped) - MIB, len(mapped) + MIB)
        assert page_cache.populate(mapped, len(mapped) + MIB, len(mapped) + 2 * MIB)
    with open(data_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert page_cache._address(mapped) is None  # read-only: mmap.madvise instead
        assert page_cache.populate(mapped, 0, MIB)


def test_reads_stay_inside_the_window(data_file):
    with ReadAhead(_groups(data_file), threads=4, window=2 * MIB, chunk=MIB // 4) as ahead:
        wait_until(lambda: ahead.waiting == 4, "every thread to wait at the window's edge")
        assert _seen(ahead) == 2 * MIB
        ahead.advance(0)  # the loader finished the first group: one more group's room
        wait_until(lambda: _seen(ahead) == 3 * MIB and ahead.waiting == 4, "one more group")
        assert _seen(ahead) == 3 * MIB


def test_the_window_moves_inside_a_group_as_the_loader_copies(data_file):
    """A group far larger than the window (a MoE layer's experts): the threads stop at the
    window's edge inside it, and go on as the loader reports what it has copied of it."""
    one_group = [[Span(data_file, 0, 10 * MIB)]]
    with ReadAhead(one_group, threads=4, window=2 * MIB, chunk=MIB // 4) as ahead:
        wait_until(lambda: ahead.waiting == 4, "every thread to wait at the window's edge")
        assert _seen(ahead) == 2 * MIB
        ahead.progress(MIB)
        ahead.progress(MIB // 2)
        wait_until(lambda: _seen(ahead) == 3 * MIB + MIB // 2 and ahead.waiting == 4,
                   "the window to move on by what was copied")  # fmt: skip
        assert _seen(ahead) == 3 * MIB + MIB // 2


def test_groups_the_loader_has_passed_are_skipped(data_file):
    ahead = ReadAhead(_groups(data_file), threads=2, window=64 * MIB, chunk=MIB)
    ahead.advance(5)  # the loader is past group 5 before a thread starts
    with ahead:
        wait_until(lambda: _seen(ahead) == 4 * MIB, "groups 6 to 9")
    assert _seen(ahead) == 4 * MIB


def test_an_unreadable_span_is_left_to_the_loader(data_file, tmp_path):
    plan = [[Span(tmp_path / "gone.bin", 0, MIB)], [Span(data_file, 0, MIB)]]
    with ReadAhead(plan, threads=1, window=64 * MIB, chunk=MIB) as ahead:
        wait_until(lambda: _seen(ahead) == MIB, "the readable span")
        assert ahead.failed == 1
