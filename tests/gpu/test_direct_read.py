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
