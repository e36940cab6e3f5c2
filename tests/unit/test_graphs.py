"""GraphedForward's bookkeeping on the CPU (no graphs are recorded here: the CUDA side is in
tests/gpu/test_forward.py): eager results, and a bounded memory of the layouts it has seen."""

from __future__ import annotations

import torch

from consumer import graphs
from consumer.attention import TreeBounds
from consumer.graphs import GraphedForward, eager_forward
from consumer.model import TINY, build_model


def test_layouts_seen_are_remembered_within_a_bound(layout, monkeypatch) -> None:
    monkeypatch.setattr(graphs, "SEEN_LAYOUTS", 3)
    model = build_model(TINY, layout)
    forward = GraphedForward(model, max_graphs=0)  # off: counts sightings, runs eagerly
    gen = torch.Generator().manual_seed(0)
    for n in (10, 11, 12, 13, 10):
        ids = torch.randint(0, TINY.vocab_size, (2 * n,), generator=gen)
        pos = torch.cat([torch.arange(n), torch.arange(n)])
        bounds = TreeBounds.documents([n, n])
        with torch.no_grad():
            got = forward(ids, pos, bounds)
            torch.testing.assert_close(got, eager_forward(model, ids, pos, bounds))
    assert len(forward._seen) == 3 and forward.size == 0 and forward.replays == 0
    assert [segments[0][1] for segments, _ in forward._seen] == [12, 13, 10]
