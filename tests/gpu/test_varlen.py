"""Packed attention on CUDA through one variable-length flash call per layer.

- The varlen path matches a dense masked float64 reference on packed documents of mixed
  lengths and on prompts with responses (keys gathered, bottom-right causal), with grouped
  query heads, within bf16 tolerance; and it matches the per-run SDPA path it replaced.
- A forward over a batch of never-seen lengths makes one flash-attention call per layer and
  none through cuDNN (whose per-length planning made mixed traffic slow).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.forward.attention import (  # noqa: E402
    SdpaCoreAttention,
    TreeBounds,
    attention_runs,
    uses_varlen,
)
from consumer.forward.model import ModelSpec, build_model  # noqa: E402
from consumer.forward.scoring import Scorer  # noqa: E402
from consumer.group.batching import batch_from_jobs  # noqa: E402
from shared.messages import Job, TeacherRequest  # noqa: E402
from tests.reference import dense_attention, packed_segments  # noqa: E402

CUDA = torch.device("cuda")


LAYOUTS = {
    "mixed_lengths": [(37, None), (128, None), (5, None), (300, None), (1, None), (64, None)],
    "prompt_and_responses": [(70, None), (33, 0), (90, 0), (1, 0), (200, None), (17, 4)],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_matches_a_dense_reference_and_the_sdpa_path(layout: str, kv_heads: int) -> None:
    segments = packed_segments(LAYOUTS[layout])
    total, heads, dim = segments[-1][1], 8, 64
    gen = torch.Generator(device=CUDA).manual_seed(3)
    q = torch.randn(total, heads, dim, generator=gen, device=CUDA, dtype=torch.bfloat16)
    k, v = (
        torch.randn(total, kv_heads, dim, generator=gen, device=CUDA, dtype=torch.bfloat16)
        for _ in range(2)
    )
    assert uses_varlen(q)
    attn = SdpaCoreAttention(config=None)
    out = attn(q, k, v, None, packed_seq_params=TreeBounds.from_segments(segments, max_position=1))
    ref = dense_attention(q.cpu(), k.cpu(), v.cpu(), segments)  # float64 on the CPU
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=2e-2)
    per_run = attn._forward_tree(q, k, v, segments)  # the SDPA path, one call per run
    torch.testing.assert_close(out.float(), per_run.float(), atol=2e-2, rtol=2e-2)
    assert len(attention_runs(segments)) > 1  # the layouts do need several SDPA calls


def test_a_batch_of_new_lengths_makes_one_flash_call_per_layer_and_no_cudnn_call(layout):
    spec = ModelSpec(
        family="qwen2", vocab_size=1024, hidden_size=256, num_layers=3, num_attention_heads=4,
        num_kv_heads=2, ffn_hidden_size=512, max_position_embeddings=4096, qkv_bias=True,
    )  # fmt: skip
    model = build_model(spec, layout, params_dtype=torch.bfloat16, device=CUDA)
    scorer = Scorer(model=model, spec=spec, layout=layout, device=CUDA)
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 900, size=12).tolist()
    jobs = [
        Job(
            job_id=f"j{i}",
            entry_id=f"0-{i}",
            submitted_at=0.0,
            request=TeacherRequest(input_ids=rng.integers(0, 1000, n)),
        )
        for i, n in enumerate(lengths)
    ]
    batch = batch_from_jobs(jobs)
    scorer.hidden_states(batch)  # warm-up: library handles, kernels loaded
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        scorer.hidden_states(batch)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert names.count("aten::_flash_attention_forward") == spec.num_layers
    assert not any("cudnn_attention" in n for n in names)


@pytest.mark.parametrize(("dq", "dv"), [(128, 128), (192, 192), (192, 128)])
def test_one_long_document_runs_through_cudnn_and_matches_the_flash_path(dq: int, dv: int):
    """A pack that is one document of LONG_DOCUMENT rows or more (length not a multiple of
    the bucket) takes SDPA's cuDNN kernel, and agrees with the varlen flash call."""
    from consumer.forward import attention

    rows, heads = attention.LONG_DOCUMENT + 333, 4
    gen = torch.Generator(device=CUDA).manual_seed(dq + dv)
    q, k = (torch.randn(rows, heads, dq, generator=gen, device=CUDA).bfloat16() for _ in "qk")
    v = torch.randn(rows, heads, dv, generator=gen, device=CUDA).bfloat16()
    # the probe is cached per device as the tensors name it (cuda:0), and runs flash once
    if not attention.cudnn_long_documents(q.device, torch.bfloat16, dq, dv):
        pytest.skip("no cuDNN attention for these head sizes here")
    bounds = TreeBounds.from_segments(((0, rows, 0, 0),), max_position=rows - 1)
    attn = SdpaCoreAttention(config=None, softmax_scale=dq**-0.5)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = attn.attend_rotated(q, k, v, bounds)
    names = [e.name for e in prof.events()]
    assert any("cudnn_attention" in n for n in names)
    assert not any(n == "aten::_flash_attention_forward" for n in names)
    vp = torch.nn.functional.pad(v, (0, dq - dv))
    cu = torch.tensor([0, rows], dtype=torch.int32, device=CUDA)
    flash = attention.varlen_attention()(q, k, vp, cu, cu, rows, rows, scale=dq**-0.5)
    want = flash[..., :dv].reshape(rows, -1)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_long_documents_in_a_pack_run_through_cudnn_and_match_one_flash_call():
    """A pack of short and long documents (lengths not multiples of the bucket): each long one
    takes SDPA's cuDNN kernel, the short ones between varlen calls, and the joined output
    agrees with one varlen flash call over the whole pack (v padded with its own width named,
    as latent attention hands it: cuDNN takes it at that width)."""
    from consumer.forward import attention

    dq, dv, heads = 192, 128, 4
    long = attention.LONG_DOCUMENT
    lengths = [300, long + 333, 1, 500, long + 100, 7]
    bounds = TreeBounds.documents(lengths)
    rows = sum(lengths)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    q, k = (torch.randn(rows, heads, dq, generator=gen, device=CUDA).bfloat16() for _ in "qk")
    v = torch.randn(rows, heads, dv, generator=gen, device=CUDA).bfloat16()
    vp = torch.nn.functional.pad(v, (0, dq - dv))
    # the probe is cached per device as the tensors name it (cuda:0), and runs flash once
    if not attention.cudnn_long_documents(q.device, torch.bfloat16, dq, dv):
        pytest.skip("no cuDNN attention for these head sizes here")
    attn = SdpaCoreAttention(config=None, softmax_scale=dq**-0.5, value_dim=dv)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = attn.attend_rotated(q, k, vp, bounds)
    names = [e.name for e in prof.events()]
    assert sum("cudnn_attention" in n for n in names) >= 2
    assert [p.layout is None for p in bounds.pieces] == [False, True, False, True, False]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=CUDA)
    m = max(lengths)
    flash = attention.varlen_attention()(q, k, vp, cu, cu, m, m, scale=dq**-0.5)
    want = flash[..., :dv].reshape(rows, -1)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
