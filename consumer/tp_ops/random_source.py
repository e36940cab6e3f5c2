"""The counter-based random source of the samples: SplitMix64 words keyed by (seed, position,
sample, vocabulary id), their uniforms and Gumbel noise. `sampling_hash` holds the definition
of a sample, which the fused kernels reproduce bit for bit (`consumer/kernels/gumbel.py`).

Shape legend (suffixes on tensor names):
    T  rows (scored positions) of the batch
    R  rows of one chunk
    V  columns of this rank's vocabulary shard
    N  samples per row (may be 0)
    X  any number of words per row
"""

from __future__ import annotations

import torch

from consumer.head_common import MIX64_M1, MIX64_M2, SPLITMIX_GAMMA, signed64

__all__ = [
    "GAMMA_S",
    "gumbel_noise_",
    "mix64_",
    "sampling_hash",
    "stream_keys",
    "uniform_from_hash",
]

# The SplitMix64 increment as torch takes it (a signed int64 with the same bits).
GAMMA_S = signed64(SPLITMIX_GAMMA)
_MIX_STEPS = ((30, signed64(MIX64_M1)), (27, signed64(MIX64_M2)), (31, None))


def mix64_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser applied in place to the int64 words `x` (`tmp`: scratch of its
    shape); returns `x`."""
    # torch's >> on int64 is arithmetic; masking off the sign-filled bits makes it logical.
    # Multiplication wraps modulo 2**64 on CPU and CUDA, which is what the definition wants.
    for shift, mult in _MIX_STEPS:
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)
    return x


def _splitmix(state: torch.Tensor, counter: torch.Tensor | int) -> torch.Tensor:
    if isinstance(counter, int):
        x = state + signed64(counter * SPLITMIX_GAMMA)
    else:
        x = state + counter.mul(GAMMA_S)
    return mix64_(x, torch.empty_like(x))


def stream_keys(*, seed_T: torch.Tensor, position_T: torch.Tensor, sample_n: int) -> torch.Tensor:
    """Per (row, sample) stream keys, int64 [T, N]; see `sampling_hash` for the definition."""
    seed = seed_T.to(torch.int64)
    s1 = _splitmix(_splitmix(seed, 1), position_T.to(torch.int64) + 1)
    j_N = torch.arange(1, sample_n + 1, dtype=torch.int64, device=seed.device)
    return _splitmix(s1[:, None], j_N[None, :])


def sampling_hash(
    *,
    seed_T: torch.Tensor,
    position_T: torch.Tensor,
    sample_index: int,
    vocab_ids_V: torch.Tensor,
) -> torch.Tensor:
    """The 64-bit random word behind sample `sample_index` of each row, per vocab id; int64 [T, V].

    Definition (every value is a 64-bit word, arithmetic is modulo 2**64, `>>>` is the logical
    right shift; int64 tensors carry the same bit patterns):

        mix64(x):  x ^= x >>> 30;  x *= 0xBF58476D1CE4E5B9
                   x ^= x >>> 27;  x *= 0x94D049BB133111EB
                   x ^= x >>> 31;  return x
        SM(s, c) = mix64(s + c * 0x9E3779B97F4A7C15)   # output c of SplitMix64 seeded with s
        key(seed, position, j) = SM(SM(SM(seed, 1), position + 1), j + 1)
        hash(seed, position, j, c) = SM(key(seed, position, j), c)

    with seed and position the row's int64 values (two's complement) and j the 0-based sample
    index. `uniform_from_hash` turns a word into u in (0, 1) and g(u) = -log(-log(u)) is the
    Gumbel noise (fp64). Sample j of a row, over the tempered fp32 logits z of the real ids:

    1. Blocks: the ids are cut into blocks of SAMPLE_BLOCK consecutive GLOBAL ids (where a
       vocabulary shard starts inside a block, the two parts are separate blocks). A block b
       with first id f, largest logit m_b and mass lse_b = m_b + log(sum of E(z_v - m_b) over
       its ids) (E: `sampling_exp`, fp32 terms summed in fp64; the log in fp64) has key
       fp32(lse_b + g(u)) with u from hash(seed, position, j, -(f + 1)); the largest key wins,
       ties to the lowest block.
    2. Inside the winning block: each id v has key z_v + fp32(g(u)) with u from
       hash(seed, position, j, v + 1); the largest wins, ties to the lowest id.

    Step 1 picks block b with probability exp(lse_b) / sum exp(z) (up to E's relative error,
    below 2e-7 + 8e-8 |y|) and step 2 picks v with
    probability exp(z_v - lse_b): v is drawn from softmax(z), with O(V / SAMPLE_BLOCK) random
    words per sample instead of O(V). Nothing depends on the batch layout or chunking, nor on
    the TP size where shards are multiples of SAMPLE_BLOCK. This function returns the words
    of step 2, hash(seed, position, sample_index, v + 1) for the given ids v.
    """
    keys_T1 = stream_keys(seed_T=seed_T, position_T=position_T, sample_n=sample_index + 1)[
        :, sample_index : sample_index + 1
    ]
    out_TV = keys_T1 + (vocab_ids_V.to(torch.int64) + 1).mul(GAMMA_S)[None, :]
    return mix64_(out_TV, torch.empty_like(out_TV))


def _uniform_into(hash_RX: torch.Tensor, tmp_RX: torch.Tensor) -> torch.Tensor:
    # Reuses hash_RX's storage for the fp64 result; tmp_RX is scratch.
    torch.bitwise_right_shift(hash_RX, 12, out=tmp_RX)
    tmp_RX.bitwise_and_((1 << 52) - 1)
    u_RX = hash_RX.view(torch.float64)
    u_RX.copy_(tmp_RX)
    # (2k + 1) / 2**53 is exact in fp64 for k < 2**52, so u never reaches 0 or 1.
    return u_RX.mul_(2.0**-52).add_(2.0**-53)


def uniform_from_hash(hash_TV: torch.Tensor) -> torch.Tensor:
    """fp64 uniforms u = (2 * (hash >>> 12) + 1) / 2**53 in the open interval (0, 1)."""
    return _uniform_into(hash_TV.clone(), torch.empty_like(hash_TV)).clone()


def gumbel_noise_(words_RX: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) in fp64 for hash(c) = mix64(words_RX), with u its uniform
    (`uniform_from_hash`). Consumes `words_RX`: the result lives in its storage."""
    hash_RX = mix64_(words_RX, torch.empty_like(words_RX))
    return _uniform_into(hash_RX, torch.empty_like(hash_RX)).log_().neg_().log_().neg_()
