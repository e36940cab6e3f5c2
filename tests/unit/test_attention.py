"""SdpaCoreAttention on packed segments against an independent reference: dense masked
softmax attention in float64 over the whole pack, its [T, T] mask built from the segments."""

from __future__ import annotations

import pytest
import torch

from consumer.forward.attention import SdpaCoreAttention, TreeBounds, attention_runs
from tests.reference import dense_attention, packed_segments

LAYOUTS = {
    "equal_documents": [(16, None)] * 4,
    "mixed_lengths": [(8, None), (8, None), (5, None), (8, None), (8, None), (8, None), (3, None)],
    "prompt_and_responses": [(6, None), (4, 0), (7, 0), (9, None), (9, None), (5, 3)],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_packed_attention_matches_a_dense_masked_reference(layout: str, kv_heads: int) -> None:
    segments = packed_segments(LAYOUTS[layout])
    total, heads, dim = segments[-1][1], 4, 8
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(total, heads, dim, generator=gen)
    k, v = (torch.randn(total, kv_heads, dim, generator=gen) for _ in range(2))
    params = TreeBounds.from_segments(segments, max_position=total)
    out = SdpaCoreAttention(config=None)(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, segments), atol=1e-5, rtol=0)


def test_adjacent_documents_of_one_length_share_a_call() -> None:
    segments = packed_segments(LAYOUTS["mixed_lengths"])
    assert [(docs, end - start) for start, end, docs, _, _ in attention_runs(segments)] == [
        (2, 16), (1, 5), (3, 24), (1, 3)
    ]  # fmt: skip
    with_prompt = packed_segments(LAYOUTS["prompt_and_responses"])
    assert [docs for *_, docs, _, _ in attention_runs(with_prompt)] == [1, 0, 0, 2, 0]


def test_documents_restart_positions_through_one_sequence_for_rope() -> None:
    bounds = TreeBounds.documents([3, 5, 2])
    assert bounds.segments == ((0, 3, 0, 0), (3, 8, 3, 3), (8, 10, 8, 8))
    assert bounds.cu_seqlens_q.tolist() == [0, 10] and bounds.cu_seqlens_q.device.type == "cpu"
    assert bounds.max_seqlen_q == 5


def test_documents_longer_than_the_configured_positions_match_megatrons_own_rope(layout) -> None:
    """Packed forwards rotate q and k in SdpaCoreAttention from the model's own tables, which
    grow past max_position_embeddings when a job is longer; megatron's unpacked path (its own
    RoPE) is the reference."""
    import dataclasses

    from consumer.forward.model import TINY, build_model

    spec = dataclasses.replace(TINY, max_position_embeddings=64)
    model = build_model(spec, layout)
    ids = torch.randint(0, spec.vocab_size, (1, 100), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(100)[None]
    with torch.no_grad():
        reference = model(ids, positions, attention_mask=None)[:, 0]
        packed = model(
            ids, positions, attention_mask=None, packed_seq_params=TreeBounds.documents([100])
        )[:, 0]
        assert model.rope_tables(torch.device("cpu"))[0].shape[0] == 128  # grown
        two = model(
            ids.repeat(1, 2),
            positions.repeat(1, 2),
            attention_mask=None,
            packed_seq_params=TreeBounds.documents([100, 100]),
        )[:, 0]
    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two[:100], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two[100:], reference, atol=1e-5, rtol=1e-5)


def test_one_long_document_path_pads_to_the_bucket_without_changing_a_row() -> None:
    """The long-document path (SDPA's cuDNN kernel on CUDA) pads the document to a multiple
    of LONG_BUCKET and cuts the result back: here through SDPA's math kernel, against a dense
    float64 reference, with v narrower than q and k as latent attention has it."""
    from torch.nn.attention import SDPBackend

    from consumer.forward import attention

    rows, heads, dq, dv = attention.LONG_BUCKET + 5, 2, 24, 16
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(rows, heads, dq, generator=gen) for _ in "qk")
    v = torch.randn(rows, heads, dv, generator=gen)
    got = attention._cudnn_causal(q, k, v, scale=None, backend=SDPBackend.MATH)
    assert got.shape == (rows, heads * dv)
    want = dense_attention(q, k, v, [(0, rows, 0, 0)])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _varlen_by_documents(q, k, v, cu_q, cu_k, max_q, max_k, *, scale):
    """A stand-in for the varlen kernel on the CPU: causal SDPA (math kernel) per document of
    the cumulative lengths, which must match for q and k. [rows, heads, d_v]."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, scale=scale
        )
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def test_long_documents_are_cut_out_of_a_pack(monkeypatch) -> None:
    """Each long document is a piece of its own; the documents between two long ones share
    one varlen piece, its cumulative lengths counted from the piece's first row; a pack with
    no long document, or with a shared prompt, is not cut."""
    from consumer.forward import attention

    monkeypatch.setattr(attention, "LONG_DOCUMENT", 50)
    cpu = torch.device("cpu")
    segments = packed_segments([(10, None), (7, None), (60, None), (50, None), (3, None)])
    pieces = attention.long_document_pieces(segments, cpu)
    assert [(p.start, p.end, p.layout is None) for p in pieces] == [
        (0, 17, False), (17, 77, True), (77, 127, True), (127, 130, False)
    ]  # fmt: skip
    assert pieces[0].layout.cu_q.tolist() == [0, 10, 17] and pieces[0].layout.max_q == 10
    assert pieces[3].layout.cu_q.tolist() == [0, 3] and pieces[3].layout.kv_rows is None
    assert attention.long_document_pieces(packed_segments([(49, None)] * 3), cpu) == ()
    shared_prompt = packed_segments([(60, None), (5, 0), (70, 0)])
    assert attention.long_document_pieces(shared_prompt, cpu) == ()


@pytest.mark.parametrize("v_padded", [False, True])
def test_a_pack_cut_at_its_long_documents_matches_a_dense_reference(monkeypatch, v_padded) -> None:
    """The pieces' outputs, joined, are the pack's attention: the long documents through the
    padded causal path (SDPA's math kernel standing in for cuDNN), the rest through a varlen
    stand-in, against dense float64 attention over the whole pack; v narrower than q and k,
    as latent attention has it. Handed v zero-padded to q's width with its own width named
    (`value_dim`, as latent attention does), the long documents attend at that width."""
    from torch.nn.attention import SDPBackend

    from consumer.forward import attention

    monkeypatch.setattr(attention, "LONG_DOCUMENT", 40)
    monkeypatch.setattr(attention, "LONG_BUCKET", 16)
    segments = packed_segments([(9, None), (45, None), (1, None), (12, None), (41, None)])
    total, heads, dq, dv = segments[-1][1], 2, 24, 16
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(total, heads, dq, generator=gen) for _ in "qk")
    v = torch.randn(total, heads, dv, generator=gen)
    pieces = attention.long_document_pieces(segments, torch.device("cpu"))
    assert [p.layout is None for p in pieces] == [False, True, False, True]
    attn = SdpaCoreAttention(
        config=None, softmax_scale=dq**-0.5, value_dim=dv if v_padded else None
    )
    widths = []

    def causal(q, k, v, *, scale):
        widths.append(v.shape[-1])
        return attention._cudnn_causal(q, k, v, scale=scale, backend=SDPBackend.MATH)

    handed = torch.nn.functional.pad(v, (0, dq - dv)) if v_padded else v
    got = attn.attend_pieces(q, k, handed, pieces, causal=causal, attend=_varlen_by_documents)
    assert widths == [dv, dv]
    assert got.shape == (total, heads * dv)
    want = dense_attention(q, k, v, segments)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
