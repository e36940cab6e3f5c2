"""Latent attention's queries, keys and values laid out for the flash kernel in one pass.

`consumer/forward/mla.py` gets per token q [heads, nope + rope] from the query projection,
k_nope and v [heads, nope + v] from the key/value up-projection, and one rotated key part
k_pe [rope] shared by every head. The varlen flash kernel wants q, k and v as contiguous
[tokens, heads, d] with one head size d = rope + nope: q and k as [rotated rope dims | nope
dims], v zero-padded to d. In PyTorch ops that is two de-interleaves, two concatenations, a
pad and two RoPE passes (each a concatenation again): about 25 kernels and seven full copies
per layer. This kernel reads q, kv and k_pe once and writes the three tensors once.

The rotation is the rotate-half one on de-interleaved pairs (`interleaved`: the checkpoint
stores the rope dims as pairs a0 b0 a1 b1 ..., DeepSeek's `rope_interleave`), by the row's cos
and sin [rope / 2] (float32, YaRN's mscale included), in float32 and rounded once to the
output dtype, as `consumer/kernels/rope.py` does for the other families.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from consumer.kernels.launch import Shaped, launch


@triton.jit
def _mla_qkv_kernel(
    q_ptr,
    kv_ptr,
    kpe_ptr,
    cos_ptr,
    sin_ptr,
    q_out,
    k_out,
    v_out,
    heads,
    q_row_stride,
    q_head_stride,
    kv_row_stride,
    kv_head_stride,
    kpe_row_stride,
    NOPE: tl.constexpr,
    NOPE_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    V: tl.constexpr,
    D_P2: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    d = 2 * HALF + NOPE  # the output head size
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live_h = h[:, None] < heads
    j = tl.arange(0, HALF_P2)
    live_j = j < HALF
    rot = live_h & live_j[None, :]
    c = tl.load(cos_ptr + row * HALF + j, mask=live_j, other=0.0)[None, :]
    s = tl.load(sin_ptr + row * HALF + j, mask=live_j, other=0.0)[None, :]
    if INTERLEAVED:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + HALF
    n = tl.arange(0, NOPE_P2)
    nope = live_h & (n < NOPE)[None, :]
    ty = q_out.dtype.element_ty
    out_row = row * heads * d + h[:, None] * d

    # q: [nope | rope] in, [rotated rope | nope] out
    src = q_ptr + row * q_row_stride + h[:, None] * q_head_stride
    x1 = tl.load(src + NOPE + first[None, :], mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(src + NOPE + second[None, :], mask=rot, other=0.0).to(tl.float32)
    tl.store(q_out + out_row + j[None, :], (x1 * c - x2 * s).to(ty), mask=rot)
    tl.store(q_out + out_row + HALF + j[None, :], (x2 * c + x1 * s).to(ty), mask=rot)
    tl.store(q_out + out_row + 2 * HALF + n[None, :], tl.load(src + n[None, :], mask=nope), nope)

    # k: the shared k_pe rotated once, for every head, then each head's k_nope
    pe = kpe_ptr + row * kpe_row_stride
    p1 = tl.load(pe + first, mask=live_j, other=0.0).to(tl.float32)[None, :]
    p2 = tl.load(pe + second, mask=live_j, other=0.0).to(tl.float32)[None, :]
    zero = tl.zeros((BLOCK_H, HALF_P2), dtype=tl.float32)
    tl.store(k_out + out_row + j[None, :], (zero + p1 * c - p2 * s).to(ty), mask=rot)
    tl.store(k_out + out_row + HALF + j[None, :], (zero + p2 * c + p1 * s).to(ty), mask=rot)
    kv = kv_ptr + row * kv_row_stride + h[:, None] * kv_head_stride
    tl.store(k_out + out_row + 2 * HALF + n[None, :], tl.load(kv + n[None, :], mask=nope), nope)

    # v: [v | zeros] to the head size
    w = tl.arange(0, D_P2)
    value = tl.load(kv + NOPE + w[None, :], mask=live_h & (w < V)[None, :], other=0.0)
    tl.store(v_out + out_row + w[None, :], value, mask=live_h & (w < d)[None, :])


def mla_qkv(
    q: torch.Tensor,
    kv: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    nope: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, key, value), each a contiguous [tokens, heads, rope + nope] tensor, from q
    [tokens, heads, nope + rope], kv [tokens, heads, nope + v] and k_pe [tokens, rope] (last
    dims contiguous; rows and heads at any stride), cos and sin [tokens, rope / 2] float32.
    Requires v <= rope + nope."""
    rows, heads, qk = q.shape
    d = qk
    out = [torch.empty(rows, heads, d, dtype=q.dtype, device=q.device) for _ in range(3)]
    _launch(q, kv, k_pe, cos, sin, *out, nope=nope, interleaved=interleaved)
    return out[0], out[1], out[2]


def _launch(q, kv, k_pe, cos, sin, q_out, k_out, v_out, *, nope, interleaved, compile_only=False):
    rows, heads, qk = q.shape
    half = (qk - nope) // 2
    v = kv.shape[-1] - nope
    width = max(qk, kv.shape[-1])
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // triton.next_power_of_2(width)))
    grid = (rows, triton.cdiv(heads, block_h))
    launch(
        _mla_qkv_kernel,
        grid,
        q,
        kv,
        k_pe,
        cos,
        sin,
        q_out,
        k_out,
        v_out,
        heads,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        k_pe.stride(0),
        NOPE=nope,
        NOPE_P2=triton.next_power_of_2(nope),
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        V=v,
        D_P2=triton.next_power_of_2(qk),
        INTERLEAVED=interleaved,
        BLOCK_H=block_h,
        compile_only=compile_only,
    )


def precompile(
    *,
    heads: int,
    nope: int,
    rope: int,
    v: int,
    latent: int,
    dtype: torch.dtype,
    interleaved: bool,
) -> None:
    """Compile, without launching, the variant `mla_qkv` launches for `heads` heads of these
    dims as TeacherMLA hands them over: k_pe a view of the [latent + rope] down-projection
    (consumer/serve/precompile.py)."""
    qk = nope + rope
    q = Shaped(dtype, (1, heads, qk), (heads * qk, qk, 1))
    kv = Shaped(dtype, (1, heads, nope + v), (heads * (nope + v), nope + v, 1))
    k_pe = Shaped(dtype, (1, rope), (latent + rope, 1))
    angles = Shaped(torch.float32, (1, rope // 2))
    out = Shaped(dtype, (1, heads, qk))
    _launch(q, kv, k_pe, angles, angles, out, out, out, nope=nope, interleaved=interleaved,
            compile_only=True)  # fmt: skip
