"""How the loader's writer cuts a host tensor into pieces and copies joined parts into place
(consumer/forward/weight_copy.py); tests/gpu/test_direct_read.py streams them through
page-locked buffers."""

from __future__ import annotations

import pytest
import torch

from consumer.checkpoints import hf_files
from consumer.forward.weight_copy import Joined, ParamWriter, row_pieces


@pytest.mark.parametrize(
    ("rows", "row_bytes", "piece_bytes"),
    [(40, 600, 4096), (3, 10_000, 4096), (1, 10, 4096), (256, 58_720_256, 64 << 20), (7, 8, 64)],
)
def test_pieces_cover_every_row_once_and_stay_within_the_piece_size(rows, row_bytes, piece_bytes):
    pieces = row_pieces(rows, row_bytes, piece_bytes)
    covered = [r for piece in pieces for r in range(piece.start, piece.stop)]
    assert covered == list(range(rows))
    for piece in pieces:
        n = piece.stop - piece.start
        assert n >= 1
        assert n == 1 or n * row_bytes <= piece_bytes
    # as few pieces as the size allows
    per_piece = max(1, piece_bytes // row_bytes)
    assert len(pieces) == -(-rows // per_piece)


def test_on_the_cpu_the_writer_copies_directly():
    writer = ParamWriter(torch.device("cpu"))
    param = torch.zeros(5, 3, dtype=torch.bfloat16)
    host = torch.arange(15, dtype=torch.float32).view(5, 3)
    writer.write(param, host)
    writer.finish()
    assert torch.equal(param, host.to(torch.bfloat16))


def test_readers_joins_stay_parts_inside_joined_lazily_and_land_in_place():
    """A MoE layer's experts as a reader builds them (each expert's gate and up stacked, the
    experts stacked): under `joined_lazily` a `Joined` of views, which the writer copies part
    by part into the parameter; outside it the same tensor, joined on the host."""
    gen = torch.Generator().manual_seed(5)
    gates = [torch.randn(4, 6, generator=gen) for _ in range(3)]
    ups = [torch.randn(4, 6, generator=gen) for _ in range(3)]

    def experts():
        return hf_files.stack([hf_files.stack([g, u]) for g, u in zip(gates, ups, strict=True)])

    expected = torch.stack([torch.stack([g, u]) for g, u in zip(gates, ups, strict=True)])
    assert torch.equal(experts(), expected)
    with hf_files.joined_lazily():
        lazy = experts()
        by_columns = hf_files.stack([gates[0], ups[0]], dim=1)
    assert isinstance(lazy, Joined) and lazy.shape == expected.shape
    assert all(isinstance(p, Joined) for p in lazy.parts)  # nothing was joined yet
    assert torch.equal(lazy.tensor(), expected)
    param = torch.full(expected.shape, float("nan"))
    writer = ParamWriter(torch.device("cpu"))
    writer.write(param, lazy)
    writer.write(columns := torch.empty(4, 2, 6), by_columns)
    writer.finish()
    assert torch.equal(param, expected)
    assert torch.equal(columns, torch.stack([gates[0], ups[0]], dim=1))


def test_a_joined_refuses_a_negative_new_dimension():
    with pytest.raises(ValueError, match="dimension >= 0"):
        Joined([torch.zeros(2, 3)], 0).unsqueeze(-1)
