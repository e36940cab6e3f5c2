"""Weight updates in place (consumer/serve/reload.py `Reloader`), on real Hugging Face checkpoints
and a real CPU model: a same-shape checkpoint overwrites the parameters where they are (same
tensors, new values: the new teacher's), another shape is built anew, and the old weights come
back when the load fails part-way or a peer rank failed (`undo`)."""

from __future__ import annotations

import pytest
import torch

from consumer.checkpoints import load_teacher
from consumer.checkpoints.hf import HfCheckpoint
from consumer.forward.scoring import Scorer
from consumer.serve.reload import Reloader


@pytest.fixture(scope="module")
def ckpts(hf_checkpoint):
    """Two Qwen2 teachers of one shape and one of another."""
    return (
        hf_checkpoint("qwen2", "inplace-a", seed=21),
        hf_checkpoint("qwen2", "inplace-b", seed=22),
        hf_checkpoint("qwen2", "inplace-wide", seed=23, intermediate_size=96),
    )


def _setup(layout, path):
    builds: list[str] = []

    def build(p: str):
        builds.append(p)
        model, spec, version = load_teacher(p, layout, params_dtype=torch.float32, device="cpu")
        return Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu")), version

    scorer, _ = build(str(path))
    builds.clear()
    reloader = Reloader(
        scorer=scorer, path=str(path), configured=None, build=build, warm=lambda s: None
    )
    return reloader, scorer, builds


def _weights(scorer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in scorer.model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def test_same_shape_overwrites_in_place_and_other_shape_rebuilds(layout, ckpts) -> None:
    """Same shape: the same parameter tensors (same storage) now hold exactly what a fresh
    load of the new checkpoint holds, and nothing was built. Another shape: a new model."""
    a, b, wide = ckpts
    reloader, scorer, builds = _setup(layout, a)
    storages = [p.data_ptr() for p in scorer.model.parameters()]
    fresh_b = _weights(_setup(layout, b)[1])
    got, version = reloader(str(b))
    assert got is scorer and reloader.last_in_place and builds == []
    assert version.startswith("inplace-b@")
    assert [p.data_ptr() for p in scorer.model.parameters()] == storages
    assert _same(_weights(scorer), fresh_b)

    rebuilt, version = reloader(str(wide))
    assert rebuilt is not scorer and not reloader.last_in_place and builds == [str(wide)]
    assert version.startswith("inplace-wide@")


def test_a_load_failing_part_way_puts_the_old_weights_back(layout, ckpts, monkeypatch) -> None:
    """A read error half-way through a load in place (a fault injected into the checkpoint
    reader) raises, and every parameter holds the old teacher's values again."""
    a, b, _ = ckpts
    reloader, scorer, _ = _setup(layout, a)
    before = _weights(scorer)
    real = HfCheckpoint.read
    reads = {"n": 0}

    def failing(self, name, rows=None, cols=None):
        if self.path == b and type(self) is HfCheckpoint:  # not the read-ahead's plan (meta)
            reads["n"] += 1
            if reads["n"] == 6:
                raise OSError("disk gone")
        return real(self, name, rows=rows, cols=cols)

    monkeypatch.setattr(HfCheckpoint, "read", failing)
    with pytest.raises(OSError, match="disk gone"):
        reloader(str(b))
    assert reads["n"] == 6  # it failed part-way, after overwriting some parameters
    assert _same(_weights(scorer), before)
    assert reloader.path == str(a)


def test_undo_after_a_peer_failed_restores_the_old_weights(layout, ckpts) -> None:
    """A load in place that succeeded here is undone when a peer rank failed (`load_agreed`
    calls `undo`): the old teacher's values are back, in the same tensors."""
    a, b, _ = ckpts
    reloader, scorer, _ = _setup(layout, a)
    before = _weights(scorer)
    reloader(str(b))
    assert not _same(_weights(scorer), before)
    reloader.undo()
    assert _same(_weights(scorer), before) and reloader.path == str(a)
