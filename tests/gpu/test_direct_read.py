"""A checkpoint read straight into page-locked staging buffers (consumer/checkpoints/
direct_read.py) loads onto the GPU exactly what the page-cache path loads: tensors taken whole
go to the device from the staging buffer without a host copy, concatenations through the
writer's own buffers; the host allocator's blocks are not reused under a copy still running."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.checkpoints import HfCheckpoint, spec_from_hf_config  # noqa: E402
from consumer.checkpoints.hf import load_hf_weights  # noqa: E402
from consumer.checkpoints.page_cache import evict  # noqa: E402
from consumer.forward.model import build_model  # noqa: E402


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_a_direct_load_equals_the_page_cache_load(hf_checkpoint, layout, family):
    sizes = {"num_layers": 2, "num_experts": 4, "top_k": 2, "moe_intermediate_size": 64}
    path = hf_checkpoint(family, f"gpu-direct-{family}", seed=9, vocab_size=4096,
                         **(sizes if family == "qwen3_moe" else {}))  # fmt: skip
    spec = spec_from_hf_config(HfCheckpoint(path).config)
    loaded = []
    for direct in (False, True):
        evict(sorted(Path(path).glob("*.safetensors")))
        model = build_model(spec, layout, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        load_hf_weights(model, spec, path, layout, read_threads=8, read_direct=direct)
        loaded.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, param in loaded[0].items():
        assert not param.isnan().any(), name
        assert torch.equal(loaded[1][name], param), name


def test_the_writer_streams_pieces_through_its_buffers_exactly(monkeypatch):
    from consumer.forward import weight_copy

    monkeypatch.setattr(weight_copy, "PIECE_BYTES", 4096)  # many pieces, every buffer reused
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(40, 300, generator=gen).to(torch.bfloat16)
    hosts = {
        "rows": big,  # 600-byte rows: six rows a piece
        "columns": big[:, 100:250],  # a strided view, as a TP shard of columns is
        "wide rows": torch.randn(3, 5000, generator=gen).to(torch.bfloat16),  # a row a piece
        "cast": torch.randn(7, 9, 11, generator=gen),  # float32 into bfloat16
        "vector": torch.randn(33, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
    }
    hosts["joined by columns"] = weight_copy.Joined([big[:, :100], big[:, 100:]], 1)
    hosts["joined by rows"] = weight_copy.Joined([big[:7], big[7:]], 0)
    copied = []
    writer = weight_copy.ParamWriter(torch.device("cuda"), progress=copied.append)
    params = {}
    for name, host in hosts.items():
        params[name] = torch.full(host.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        writer.write(params[name], host)
    writer.finish()
    for name, host in hosts.items():
        whole = host.tensor() if isinstance(host, weight_copy.Joined) else host
        assert torch.equal(params[name].cpu(), whole.to(torch.bfloat16)), name
    # the read-ahead is told every byte, a piece at a time
    assert sum(copied) == sum(
        (h.tensor() if isinstance(h, weight_copy.Joined) else h).nbytes for h in hosts.values()
    )
    assert max(copied) <= 5000 * 2  # no piece above 4096 bytes but one wide row (5000 bf16)
