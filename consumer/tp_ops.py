"""Teacher outputs from tensor-parallel, vocabulary-sharded logits, never gathering the vocabulary.

Each tensor-parallel (TP) rank holds the logits of one contiguous slice of the padded vocabulary.
From those slices this module computes, per scored position (a "row"): log-probs of given target
ids, the top-k ids with their true log-probs and the log of the mass outside the top-k, samples
drawn by a two-level Gumbel-max trick from a counter-based hash (see `sampling_hash`), and the
entropy. Every output is taken
from the tempered distribution softmax(logits * inv_temperature), with padded vocabulary columns
(ids >= vocab_size) excluded everywhere.

Chunk by chunk of rows, every rank reduces its own shard in fp32 to a few numbers and
candidates per row; then one all_gather of O(3 + W + 2K + 3N) 32-bit words per row and rank
lets every rank merge the same result. Working memory is O(chunk rows x V + T x (W + K + N));
the full [T, V] logits never need to exist.

Pure tensor math: imports only torch, torch.distributed and the standard library.

Shape legend (suffixes on tensor names):
    T  rows (scored positions) of the batch
    R  rows of one chunk, R <= T
    V  columns of this rank's vocabulary shard (padded_vocab / TP)
    H  hidden size
    W  target ids per row (may be 0)
    K  top-k entries per row (may be 0)
    N  samples per row (may be 0)
    G  sampling blocks of a shard (SAMPLE_BLOCK columns each, see `sampling_hash`)
    B  columns of one sampling block
    P  tensor-parallel ranks
    C  merge candidates per row, P * K
    D  32-bit words one rank contributes per row to the gather
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "SAMPLE_BLOCK",
    "CommStats",
    "HeadOutputs",
    "VocabShard",
    "chunked_head",
    "head_from_logits",
    "sampling_exp",
    "sampling_hash",
    "stream_keys",
    "uniform_from_hash",
    "validate_temperature",
    "vocab_shard",
]

# Row chunks are sized so one fp32 [R, V] buffer holds about this many elements; the sampling
# scratch adds 16 bytes per element (an fp32 copy in blocks, its fp32 exps and their fp64
# copies) on top of the 4-byte tempered logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
# Default chunk of the fused CUDA kernels (consumer/kernels), which hold only the logits chunk.
_FUSED_CHUNK_ELEMENTS = 1 << 27

# Columns per sampling block: a sample first picks a block (by its probability mass), then a
# column inside it. Blocks are aligned to global ids; vocabulary shards padded to a multiple of
# it per rank (Megatron's default of 128 does) cut no block, so samples do not depend on TP.
SAMPLE_BLOCK = 128

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64 increment (golden ratio)
_MIX_M1 = 0xBF58476D1CE4E5B9
_MIX_M2 = 0x94D049BB133111EB
# Stand-in id for a missing candidate: above every real id, so it loses every tie.
_SENTINEL_ID = (1 << 31) - 1
_NEG_INF = float("-inf")


def _signed64(value: int) -> int:
    # torch scalars are signed int64; hand it the same 64-bit pattern as a signed number.
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GAMMA_S = _signed64(_GAMMA)
_MIX_STEPS = ((30, _signed64(_MIX_M1)), (27, _signed64(_MIX_M2)), (31, None))


# --------------------------------------------------------------------------------------------
# Layout and bookkeeping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VocabShard:
    """This rank's logits columns: global ids [start, start + size); ids >= vocab_size are padding.

    The padded vocabulary is split into equal contiguous shards in rank order, so the padding is
    a suffix of the last shard(s) and `valid_size` columns at the front of a shard are real.
    """

    start: int
    size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.size < 1 or self.vocab_size < 1:
            raise ValueError(
                f"VocabShard needs start >= 0, size >= 1 and vocab_size >= 1, got {self}"
            )

    @property
    def end(self) -> int:
        """One past the last global id of the shard (padding included)."""
        return self.start + self.size

    @property
    def valid_size(self) -> int:
        """How many leading columns of the shard are real vocabulary ids."""
        return max(0, min(self.size, self.vocab_size - self.start))


def vocab_shard(*, rank: int, tp_size: int, padded_vocab: int, vocab_size: int) -> VocabShard:
    """The shard of `rank` among `tp_size` equal, contiguous slices of the padded vocabulary."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank must lie in [0, tp_size), got rank={rank} tp_size={tp_size}")
    if padded_vocab % tp_size:
        raise ValueError(
            f"padded_vocab {padded_vocab} is not a multiple of tp_size {tp_size}; pad the "
            "vocabulary to a multiple of the tensor-parallel size"
        )
    if not 1 <= vocab_size <= padded_vocab:
        raise ValueError(
            f"vocab_size must lie in [1, padded_vocab={padded_vocab}], got {vocab_size}"
        )
    if padded_vocab >= _SENTINEL_ID:
        raise ValueError(f"padded_vocab {padded_vocab} does not fit the 31-bit id exchange")
    size = padded_vocab // tp_size
    return VocabShard(start=rank * size, size=size, vocab_size=vocab_size)


@dataclass
class CommStats:
    """Per collective kind: calls made and bytes this rank sent and received.

    Pass one as `comm=` to the head functions; it accumulates across calls. Nothing is recorded
    for TP = 1, where no collective runs.
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)

    def record(self, *, kind: str, sent: int, received: int) -> None:
        """Count one collective of `kind` that moved `sent` and `received` bytes on this rank."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + sent
        self.bytes_received[kind] = self.bytes_received.get(kind, 0) + received


@dataclass(frozen=True)
class HeadOutputs:
    """Per-row teacher outputs; identical on every rank of the TP group.

    topk ids are ordered by descending log-prob, ties by ascending id. entropy_T is None when it
    was not requested; W, K or N of 0 give [T, 0] tensors.
    """

    target_logprobs_TW: torch.Tensor  # fp32
    topk_ids_TK: torch.Tensor  # int64
    topk_logprobs_TK: torch.Tensor  # fp32, normalised over the whole vocabulary
    topk_rest_logprob_T: torch.Tensor  # fp32, log of the mass outside the top-k
    sample_ids_TN: torch.Tensor  # int64
    sample_logprobs_TN: torch.Tensor  # fp32
    entropy_T: torch.Tensor | None  # fp32, nats

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> HeadOutputs:
        """These outputs with `fn` applied to every tensor (an absent entropy stays None)."""
        return HeadOutputs(
            target_logprobs_TW=fn(self.target_logprobs_TW),
            topk_ids_TK=fn(self.topk_ids_TK),
            topk_logprobs_TK=fn(self.topk_logprobs_TK),
            topk_rest_logprob_T=fn(self.topk_rest_logprob_T),
            sample_ids_TN=fn(self.sample_ids_TN),
            sample_logprobs_TN=fn(self.sample_logprobs_TN),
            entropy_T=None if self.entropy_T is None else fn(self.entropy_T),
        )


# --------------------------------------------------------------------------------------------
# Temperature
# --------------------------------------------------------------------------------------------


def validate_temperature(*, temperature_T: torch.Tensor | Sequence[float] | float) -> torch.Tensor:
    """Check per-row temperatures and return their reciprocals as fp32 `inv_temperature_T` (CPU).

    Raises ValueError naming the first offending row when a temperature is <= 0, NaN or inf, or
    so small that its reciprocal overflows fp32.
    """
    temps = torch.as_tensor(temperature_T, dtype=torch.float64).detach().cpu().reshape(-1)
    bad = ~torch.isfinite(temps) | (temps <= 0)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"temperature must be a finite number > 0 (not <= 0, NaN or inf); row {row} has "
            f"{float(temps[row])}"
        )
    inv = (1.0 / temps).to(torch.float32)
    if not bool(torch.isfinite(inv).all()):
        row = int((~torch.isfinite(inv)).nonzero()[0, 0])
        raise ValueError(
            f"temperature {float(temps[row])} at row {row} is too small: 1/temperature "
            "overflows float32"
        )
    return inv


# --------------------------------------------------------------------------------------------
# Counter-based random source
# --------------------------------------------------------------------------------------------


def _mix64_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
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
        x = state + _signed64(counter * _GAMMA)
    else:
        x = state + counter.mul(_GAMMA_S)
    return _mix64_(x, torch.empty_like(x))


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
    out_TV = keys_T1 + (vocab_ids_V.to(torch.int64) + 1).mul(_GAMMA_S)[None, :]
    return _mix64_(out_TV, torch.empty_like(out_TV))


def _uniform_into(hash_RV: torch.Tensor, tmp_RV: torch.Tensor) -> torch.Tensor:
    # Reuses hash_RV's storage for the fp64 result; tmp_RV is scratch.
    torch.bitwise_right_shift(hash_RV, 12, out=tmp_RV)
    tmp_RV.bitwise_and_((1 << 52) - 1)
    u_RV = hash_RV.view(torch.float64)
    u_RV.copy_(tmp_RV)
    # (2k + 1) / 2**53 is exact in fp64 for k < 2**52, so u never reaches 0 or 1.
    return u_RV.mul_(2.0**-52).add_(2.0**-53)


def uniform_from_hash(hash_TV: torch.Tensor) -> torch.Tensor:
    """fp64 uniforms u = (2 * (hash >>> 12) + 1) / 2**53 in the open interval (0, 1)."""
    return _uniform_into(hash_TV.clone(), torch.empty_like(hash_TV)).clone()


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _group_layout(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _check_inputs(
    *,
    rows: int,
    width: int,
    device: torch.device,
    shard: VocabShard,
    rank: int,
    tp_size: int,
    target_ids_TW: torch.Tensor | None,
    inv_temperature_T: torch.Tensor,
    top_k: int,
    sample_n: int,
    seed_T: torch.Tensor | None,
    position_T: torch.Tensor | None,
) -> None:
    if width != shard.size:
        raise ValueError(f"logits width {width} != shard.size {shard.size}")
    if shard.start != rank * shard.size or shard.vocab_size > shard.size * tp_size:
        raise ValueError(
            f"{shard} is not the shard of TP rank {rank} of {tp_size}: shards must be equal "
            "contiguous slices in rank order (build them with vocab_shard)"
        )
    if shard.size * tp_size >= _SENTINEL_ID:
        raise ValueError("padded vocabulary does not fit the 31-bit id exchange")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if top_k > shard.vocab_size:
        raise ValueError(f"top_k {top_k} exceeds the vocabulary size {shard.vocab_size}")
    if isinstance(sample_n, bool) or not isinstance(sample_n, int) or sample_n < 0:
        raise ValueError(f"sample_n must be an int >= 0, got {sample_n!r}")

    if not inv_temperature_T.is_floating_point() or tuple(inv_temperature_T.shape) != (rows,):
        raise ValueError(
            f"inv_temperature_T must be a float tensor of shape [{rows}], got "
            f"{inv_temperature_T.dtype} {tuple(inv_temperature_T.shape)}"
        )
    _check_device("inv_temperature_T", inv_temperature_T, device)
    inv32 = inv_temperature_T.float()
    if rows and not bool((torch.isfinite(inv32) & (inv32 > 0)).all()):
        raise ValueError(
            "inv_temperature_T must hold finite values > 0, i.e. temperatures that are finite "
            "and > 0 (use validate_temperature)"
        )

    if target_ids_TW is not None:
        if target_ids_TW.dtype != torch.int64 or target_ids_TW.dim() != 2:
            raise ValueError(
                f"target_ids_TW must be an int64 [T, W] tensor, got {target_ids_TW.dtype} "
                f"{tuple(target_ids_TW.shape)}"
            )
        if target_ids_TW.shape[0] != rows:
            raise ValueError(f"target_ids_TW has {target_ids_TW.shape[0]} rows, logits {rows}")
        _check_device("target_ids_TW", target_ids_TW, device)
        if target_ids_TW.numel():
            lo, hi = int(target_ids_TW.min()), int(target_ids_TW.max())
            if lo < 0 or hi >= shard.vocab_size:
                raise ValueError(
                    f"target ids must lie in [0, vocab_size={shard.vocab_size}), got values in "
                    f"[{lo}, {hi}]"
                )

    if sample_n:
        for name, ten in (("seed_T", seed_T), ("position_T", position_T)):
            if ten is None:
                raise ValueError(f"{name} is required when sample_n > 0")
            if ten.dtype != torch.int64 or tuple(ten.shape) != (rows,):
                raise ValueError(
                    f"{name} must be an int64 tensor of shape [{rows}], got {ten.dtype} "
                    f"{tuple(ten.shape)}"
                )
            _check_device(name, ten, device)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, logits on {device} (or pass it on the CPU)")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from the host to CUDA through pinned memory, so the copy does not wait
    for work already queued on the device (a plain `.to` would sync)."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _auto_chunk_rows(chunk_rows: int | None, width: int) -> int:
    if chunk_rows is None:
        return max(1, DEFAULT_CHUNK_ELEMENTS // max(width, 1))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    return chunk_rows


# --------------------------------------------------------------------------------------------
# Per-chunk kernel
# --------------------------------------------------------------------------------------------


def _order_key(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering (value descending, then id ascending) for fp32 values, int ids."""
    # +0.0 folds -0.0 into +0.0 so equal floats share a key and the id decides.
    bits = (values + 0.0).view(torch.int32).to(torch.int64)
    # Flipping the magnitude bits of negative floats makes the signed integer order the float
    # order.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered << 32) | (0xFFFFFFFF - ids.to(torch.int64))


def _local_topk(z_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row by (value desc, column asc): a set that does not depend on the kernel."""
    vals_RK, idx_RK = torch.topk(z_RV, k, dim=1, largest=True, sorted=True)
    kth_R1 = vals_RK[:, -1:]
    n_sel_R = (vals_RK == kth_R1).sum(1)
    n_all_R = (z_RV == kth_R1).sum(1)
    fix_R = n_all_R > n_sel_R
    # torch.topk picks arbitrary members of a tie at the k-th value; swap in the lowest columns.
    if bool(fix_R.any()):
        rows_F = fix_R.nonzero().squeeze(1)
        width = z_RV.shape[1]
        cols_V = torch.arange(width, device=z_RV.device)
        tied_FV = torch.where(z_RV[rows_F] == kth_R1[rows_F], cols_V, width)
        tied_FK = torch.topk(tied_FV, k, dim=1, largest=False, sorted=True).values
        n_greater_F1 = k - n_sel_R[rows_F, None]
        slot_K = torch.arange(k, device=z_RV.device)
        src_FK = (slot_K[None, :] - n_greater_F1).clamp(min=0)
        idx_RK[rows_F] = torch.where(
            slot_K[None, :] >= n_greater_F1, tied_FK.gather(1, src_FK), idx_RK[rows_F]
        )
    return vals_RK, idx_RK


def block_layout(start: int, valid: int) -> tuple[int, int]:
    """(offset, blocks) for a shard's `valid` real columns from global id `start`: shifted
    right by offset = start mod SAMPLE_BLOCK they fill `blocks` sampling blocks, local column
    c lying in block (c + offset) // SAMPLE_BLOCK (the first and last may be partial)."""
    offset = start % SAMPLE_BLOCK
    return offset, -(-(offset + valid) // SAMPLE_BLOCK)


# 2**f on [0, 1] as a degree-5 polynomial (Horner, highest degree first), coefficients exact in
# fp32: a least-squares fit of the relative error at Chebyshev nodes, rounded to fp32. The
# largest relative error of the fp32 evaluation is 1.6e-7.
_EXP2_COEFFS = (
    float.fromhex("0x1.ebd7dcp-10"),
    float.fromhex("0x1.26ab44p-7"),
    float.fromhex("0x1.c94e96p-5"),
    float.fromhex("0x1.ebd624p-3"),
    float.fromhex("0x1.62e4f2p-1"),
    float.fromhex("0x1.fffffep-1"),
)
_LOG2E_F32 = float.fromhex("0x1.715476p+0")  # log2(e) rounded to fp32
# Below 2**-92 (y < -63.8) a term is 0: next to the block's largest term, 1, it is far below
# the fp64 sum's rounding, and every step above stays clear of fp32 denormals.
_EXP2_FLOOR = -92.0


def sampling_exp(y: torch.Tensor) -> torch.Tensor:
    """E(y) ~ exp(y) for fp32 y <= 0 (relative error below 2e-7 + 8e-8 |y|; NaN and -inf
    give 0), from fp32 multiplies and adds only, each rounded once, so every device and
    library that rounds fp32 operations to nearest computes the same bits (the fused CUDA
    kernel does: `consumer/kernels`):

        t = fp32(y * log2e32);  n = floor(max(t, -93));  f = max(t, -93) - n
        E(y) = p(f) * 2**n  where t >= -92, else 0

    with p the polynomial of `_EXP2_COEFFS` evaluated by Horner's rule (multiply, then add).
    The block masses of the samples use it (`sampling_hash`). It is cheaper on the GPU than
    the fp64 exp it replaced, and unlike a library's fp32 exp (a hardware approximation on
    CUDA, another on the CPU) it gives the same bits everywhere, so samples stay identical
    across devices.
    """
    t = y * torch.tensor(_LOG2E_F32, dtype=torch.float32, device=y.device)
    tc = t.clamp(min=_EXP2_FLOOR - 1)
    n = tc.floor()
    f = tc - n
    p = torch.full_like(f, _EXP2_COEFFS[0])
    for c in _EXP2_COEFFS[1:]:
        p = p.mul_(f).add_(c)
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2**n, exact
    return torch.where(t >= _EXP2_FLOOR, p.mul_(scale), 0.0)


def _noise(hash_RX: torch.Tensor) -> torch.Tensor:
    """-log(-log(u)) in fp64 for the words' uniforms (consumes hash_RX)."""
    return _uniform_into(hash_RX, torch.empty_like(hash_RX)).log_().neg_().log_().neg_()


def _local_samples(
    z_RV: torch.Tensor, keys_RN: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, sample): the winning block's key on this shard, the global id drawn inside
    that block and its tempered logit (the definition in `sampling_hash`)."""
    rows, sample_n = keys_RN.shape
    valid = shard.valid_size
    device = z_RV.device
    key_RN = torch.full((rows, sample_n), _NEG_INF, device=device)
    id_RN = torch.full((rows, sample_n), _SENTINEL_ID, dtype=torch.int64, device=device)
    zwin_RN = torch.full((rows, sample_n), _NEG_INF, device=device)
    if valid == 0:
        return key_RN, id_RN, zwin_RN
    width = SAMPLE_BLOCK
    offset, blocks = block_layout(shard.start, valid)
    z_RGB = torch.full((rows, blocks * width), _NEG_INF, device=device)
    z_RGB[:, offset : offset + valid] = z_RV[:, :valid]
    z_RGB = z_RGB.view(rows, blocks, width)

    # Block masses, each relative to its own max (0 for a block with no finite logit): fp32
    # terms of sampling_exp, summed and logged in fp64.
    m_RG = z_RGB.amax(dim=2)
    live_RG = m_RG > _NEG_INF
    m_RG = torch.where(live_RG, m_RG, 0.0)
    e_RGB = sampling_exp(z_RGB - m_RG[:, :, None])
    lse_RG = e_RGB.double().sum(dim=2).log_().add_(m_RG.double())
    lse_RG = torch.where(live_RG, lse_RG, _NEG_INF)
    del e_RGB

    local_G = (torch.arange(blocks, device=device) * width - offset).clamp_(min=0)
    bgamma_G = (-(local_G + shard.start + 1)).mul_(_GAMMA_S)  # counter -(first id + 1)
    local_B = torch.arange(width, device=device)
    for j in range(sample_n):
        stream_R1 = keys_RN[:, j : j + 1]
        words_RG = stream_R1 + bgamma_G
        bkey_RG = (lse_RG + _noise(_mix64_(words_RG, torch.empty_like(words_RG)))).float()
        # argmax returns the first maximal block: the lowest on ties.
        best_R = bkey_RG.argmax(dim=1)
        col_RB = best_R[:, None] * width - offset + local_B[None, :]
        inside_RB = (col_RB >= 0) & (col_RB < valid)
        col_RB.clamp_(0, valid - 1)
        zb_RB = torch.where(inside_RB, z_RV.gather(1, col_RB), _NEG_INF)
        words_RB = stream_R1 + (col_RB + shard.start + 1).mul_(_GAMMA_S)
        # The single fp64 -> fp32 rounding of the noise, then the fp32 sum.
        ekey_RB = zb_RB + _noise(_mix64_(words_RB, torch.empty_like(words_RB))).float()
        at_R = ekey_RB.argmax(dim=1, keepdim=True)
        key_RN[:, j] = bkey_RG.gather(1, best_R[:, None]).squeeze(1)
        id_RN[:, j] = col_RB.gather(1, at_R).squeeze(1) + shard.start
        zwin_RN[:, j] = zb_RB.gather(1, at_R).squeeze(1)
    return key_RN, id_RN, zwin_RN


@dataclass(frozen=True)
class _Request:
    shard: VocabShard
    tp_group: dist.ProcessGroup | None
    rank: int
    tp_size: int
    top_k: int
    sample_n: int
    want_entropy: bool
    comm: CommStats | None


def _as_words(x_RX: torch.Tensor) -> torch.Tensor:
    # fp32 travels as its bit pattern and ids as int32: ids are never cast to float.
    if x_RX.dtype == torch.float32:
        return x_RX.contiguous().view(torch.int32)
    return x_RX.to(torch.int32)


class LocalReduction(NamedTuple):
    """What one rank contributes per row before the exchange (see _exchange).

    Sums are relative to the row's finite local max (0 when it has none) and leave out the
    local top-k candidates, which travel themselves. `overflow_R` (fused kernels only) marks
    rows whose result the kernels could not guarantee; None from the reference path.
    """

    stats_R3: torch.Tensor  # fp32 [R, 3]: local max, rest sum of exp, rest sum of exp * shift
    tz_RW: torch.Tensor  # fp32, tempered logits of the targets this rank owns, -inf elsewhere
    cand_val_RK: torch.Tensor  # fp32
    cand_id_RK: torch.Tensor  # int64, global ids
    skey_RN: torch.Tensor  # fp32, best Gumbel key per sample on this shard
    sid_RN: torch.Tensor  # int64, its global id
    sz_RN: torch.Tensor  # fp32, its tempered logit
    overflow_R: torch.Tensor | None = None  # bool


def _local_reduce(
    req: _Request,
    logits_RV: torch.Tensor,
    target_ids_RW: torch.Tensor,
    inv_temperature_R: torch.Tensor,
    keys_RN: torch.Tensor | None,
) -> LocalReduction:
    """The reference (PyTorch) local reduction of one row chunk; the CPU path."""
    shard, k, n = req.shard, req.top_k, req.sample_n
    rows, width = logits_RV.shape
    device = logits_RV.device
    valid = shard.valid_size

    # One fused multiply upcasts any float dtype to fp32 and applies the temperature.
    z_RV = torch.empty((rows, width), dtype=torch.float32, device=device)
    torch.mul(logits_RV, inv_temperature_R.float()[:, None], out=z_RV)
    if valid < width:
        z_RV[:, valid:] = _NEG_INF
    m_R = z_RV.amax(dim=1)

    local_RW = target_ids_RW - shard.start
    owned_RW = (local_RW >= 0) & (local_RW < valid)
    tz_RW = z_RV.gather(1, local_RW.clamp(0, width - 1))
    # -inf from non-owners lets a max over ranks pick the owner's value.
    tz_RW = torch.where(owned_RW, tz_RW, _NEG_INF)

    cand_val_RK = torch.full((rows, k), _NEG_INF, device=device)
    cand_id_RK = torch.full((rows, k), _SENTINEL_ID, dtype=torch.int64, device=device)
    local_idx = None
    if k:
        k_local = min(k, width)
        vals, local_idx = _local_topk(z_RV, k_local)
        cand_val_RK[:, :k_local] = vals
        cand_id_RK[:, :k_local] = local_idx + shard.start

    if n:
        assert keys_RN is not None  # the caller derives them whenever n > 0
        skey_RN, sid_RN, sz_RN = _local_samples(z_RV, keys_RN, shard)
    else:
        skey_RN = sz_RN = torch.empty((rows, 0), device=device)
        sid_RN = torch.empty((rows, 0), dtype=torch.int64, device=device)

    # Sums relative to the local max; a shard with no finite logit uses 0 so -inf - -inf never
    # occurs (its sum is then 0 and the merge ignores it).
    m_safe_R = torch.where(torch.isfinite(m_R), m_R, 0.0)
    y_RV = z_RV.sub_(m_safe_R[:, None])
    e_RV = torch.exp(y_RV) if req.want_entropy else y_RV.exp_()
    # The local top-k candidates travel to every rank, which adds their mass back itself: the
    # mass outside the global top-k is then a sum of positive terms, never a difference.
    if local_idx is not None:
        e_RV.scatter_(1, local_idx, 0.0)
    s_rest_R = e_RV.sum(dim=1)
    if req.want_entropy:
        # nansum: exp(-inf) * -inf = 0 * -inf is NaN for masked or -inf columns that add 0.
        u_rest_R = torch.nansum(e_RV.mul_(y_RV), dim=1)
    else:
        u_rest_R = torch.zeros_like(s_rest_R)
    del z_RV, y_RV, e_RV

    stats_R3 = torch.stack([m_R, s_rest_R, u_rest_R], dim=1)
    return LocalReduction(stats_R3, tz_RW, cand_val_RK, cand_id_RK, skey_RN, sid_RN, sz_RN)


# Switch for benchmarks and tests: False runs the reference path on CUDA too.
FUSED_KERNELS = True


def triton_kernels(device: torch.device):  # -> the consumer.kernels module or None
    """consumer.kernels (the fused Triton kernels: head, SwiGLU, RoPE) for tensors on
    `device`, or None where they do not run (not CUDA, or no Triton: PyTorch serves then)."""
    if device.type != "cuda":
        return None
    try:
        from consumer import kernels
    except ImportError:  # no Triton here: the reference path serves CUDA as well
        return None
    return kernels


def _fused_backend(device: torch.device):  # -> the consumer.kernels module or None
    """consumer.kernels when the chunk can run through the fused Triton kernels, else None."""
    return triton_kernels(device) if FUSED_KERNELS else None


def _exchange(
    req: _Request, local: LocalReduction, w: int
) -> tuple[HeadOutputs, torch.Tensor, torch.Tensor | None]:
    """Every rank's LocalReduction gathered and merged: the outputs, a [R] mask of rows whose
    logits were unusable, and (fused kernels only) a [R] mask of rows the kernels could not
    finish exactly."""
    payload_RD = torch.cat(
        [
            _as_words(local.stats_R3),
            _as_words(local.tz_RW),
            _as_words(local.cand_val_RK),
            _as_words(local.cand_id_RK),
            _as_words(local.skey_RN),
            _as_words(local.sid_RN),
            _as_words(local.sz_RN),
        ],
        dim=1,
    )
    gathered_PRD = _all_gather_rows(payload_RD, req)
    out, bad_R = _merge(req, gathered_PRD, w)
    return out, bad_R, local.overflow_R


def _all_gather_rows(payload_RD: torch.Tensor, req: _Request) -> torch.Tensor:
    if req.tp_size == 1:
        return payload_RD[None]
    rows, words = payload_RD.shape
    # The concatenated [P * R, D] form is the one every backend accepts.
    out_PRD = torch.empty(
        (req.tp_size * rows, words), dtype=payload_RD.dtype, device=payload_RD.device
    )
    _gather_single(out_PRD, payload_RD.contiguous(), group=req.tp_group)
    if req.comm is not None:
        nbytes = payload_RD.numel() * payload_RD.element_size()
        req.comm.record(kind="all_gather", sent=nbytes, received=nbytes * req.tp_size)
    return out_PRD.view(req.tp_size, rows, words)


# all_gather_single replaces all_gather_into_tensor in newer torch; same contract.
_gather_single: Callable[..., object] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)


def _merge(req: _Request, gathered_PRD: torch.Tensor, w: int) -> tuple[HeadOutputs, torch.Tensor]:
    k, n = req.top_k, req.sample_n
    offsets = [0, 3, 3 + w, 3 + w + k, 3 + w + 2 * k, 3 + w + 2 * k + n, 3 + w + 2 * k + 2 * n]
    offsets.append(offsets[-1] + n)

    def field_(i: int, as_float: bool) -> torch.Tensor:
        words = gathered_PRD[..., offsets[i] : offsets[i + 1]].contiguous()
        return words.view(torch.float32) if as_float else words.to(torch.int64)

    stats_PR3 = field_(0, True)
    m_PR, s_rest_PR, u_rest_PR = stats_PR3.unbind(dim=2)
    tz_RW = field_(1, True).amax(dim=0)
    cand_val_RC = field_(2, True).permute(1, 0, 2).flatten(1)
    cand_id_RC = field_(3, False).permute(1, 0, 2).flatten(1)
    skey_PRN, sid_PRN, sz_PRN = field_(4, True), field_(5, False), field_(6, True)

    big_m_R = m_PR.amax(dim=0)
    live_PR = s_rest_PR > 0
    w_PR = torch.where(live_PR, torch.exp(m_PR - big_m_R), 0.0)
    rest_R = (w_PR * s_rest_PR).sum(dim=0)

    e_RC = torch.where(cand_val_RC > _NEG_INF, torch.exp(cand_val_RC - big_m_R[:, None]), 0.0)
    if k:
        _, top_pos_RK = torch.topk(_order_key(cand_val_RC, cand_id_RC), k, dim=1)
        in_top_RC = torch.zeros_like(e_RC, dtype=torch.bool).scatter_(1, top_pos_RK, True)
        rest_R = rest_R + torch.where(in_top_RC, 0.0, e_RC).sum(dim=1)
        sum_R = rest_R + torch.where(in_top_RC, e_RC, 0.0).sum(dim=1)
        topk_ids_RK = cand_id_RC.gather(1, top_pos_RK)
        topk_val_RK = cand_val_RC.gather(1, top_pos_RK)
    else:
        sum_R = rest_R
        topk_ids_RK = cand_id_RC[:, :0]
        topk_val_RK = cand_val_RC[:, :0]
    lse_R = big_m_R + torch.log(sum_R)
    bad_R = ~torch.isfinite(lse_R)

    entropy_R = None
    if req.want_entropy:
        shift_PR = torch.where(live_PR, m_PR - big_m_R, 0.0)
        acc_R = (w_PR * (u_rest_PR + shift_PR * s_rest_PR)).sum(dim=0)
        acc_R = acc_R + torch.where(e_RC > 0, e_RC * (cand_val_RC - big_m_R[:, None]), 0.0).sum(
            dim=1
        )
        # H = -sum p log p with p = e / S and log p = (z - M) - log S.
        entropy_R = torch.log(sum_R) - acc_R / sum_R
        bad_R |= ~torch.isfinite(entropy_R)

    if n:
        best_P_RN = _order_key(skey_PRN, sid_PRN).argmax(dim=0, keepdim=True)
        sample_ids_RN = sid_PRN.gather(0, best_P_RN).squeeze(0)
        sample_z_RN = sz_PRN.gather(0, best_P_RN).squeeze(0)
    else:
        sample_ids_RN = sid_PRN[0]
        sample_z_RN = sz_PRN[0]

    out = HeadOutputs(
        target_logprobs_TW=tz_RW - lse_R[:, None],
        topk_ids_TK=topk_ids_RK,
        topk_logprobs_TK=topk_val_RK - lse_R[:, None],
        topk_rest_logprob_T=torch.log(rest_R) - torch.log(sum_R),
        sample_ids_TN=sample_ids_RN,
        sample_logprobs_TN=sample_z_RN - lse_R[:, None],
        entropy_T=entropy_R,
    )
    return out, bad_R


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _HeadCall:
    """The inputs of one head call, as `head_from_logits` / `chunked_head` received them."""

    rows: int
    width: int
    device: torch.device
    logits_chunk: Callable[[int, int], torch.Tensor]
    shard: VocabShard
    tp_group: dist.ProcessGroup | None
    target_ids_TW: torch.Tensor | None
    inv_temperature_T: torch.Tensor
    top_k: int
    sample_n: int
    seed_T: torch.Tensor | None
    position_T: torch.Tensor | None
    want_entropy: bool
    chunk_rows: int | None
    comm: CommStats | None


def _run_chunks(
    call: _HeadCall, *, allow_fused: bool = True, deferred: bool = False
) -> Any:  # HeadOutputs, or PendingHead when deferred
    rows, width, device, shard, tp_group = (
        call.rows, call.width, call.device, call.shard, call.tp_group
    )  # fmt: skip
    top_k, sample_n, want_entropy, chunk_rows = (
        call.top_k, call.sample_n, call.want_entropy, call.chunk_rows
    )  # fmt: skip
    target_ids_TW, inv_temperature_T = call.target_ids_TW, call.inv_temperature_T
    seed_T, position_T = call.seed_T, call.position_T
    rank, tp_size = _group_layout(tp_group)
    _check_inputs(
        rows=rows,
        width=width,
        device=device,
        shard=shard,
        rank=rank,
        tp_size=tp_size,
        target_ids_TW=target_ids_TW,
        inv_temperature_T=inv_temperature_T,
        top_k=top_k,
        sample_n=sample_n,
        seed_T=seed_T,
        position_T=position_T,
    )
    inv_temperature_T = to_device(inv_temperature_T, device)
    target_ids_TW, seed_T, position_T = (
        None if t is None else to_device(t, device) for t in (target_ids_TW, seed_T, position_T)
    )
    fused = _fused_backend(device) if allow_fused else None
    if fused is not None and chunk_rows is None:
        # The kernels keep no fp32 [R, V] scratch, so the default chunk can be larger.
        chunk_rows = max(1, _FUSED_CHUNK_ELEMENTS // max(width, 1))
    step = _auto_chunk_rows(chunk_rows, width)
    if target_ids_TW is None:
        target_ids_TW = torch.empty((rows, 0), dtype=torch.int64, device=device)
    w = target_ids_TW.shape[1]
    req = _Request(shard, tp_group, rank, tp_size, top_k, sample_n, want_entropy, call.comm)

    keys_TN = None
    if sample_n:
        assert seed_T is not None and position_T is not None  # checked above
        keys_TN = stream_keys(seed_T=seed_T, position_T=position_T, sample_n=sample_n)

    # Each rank reduces its shard chunk by chunk to a few numbers per row, then one exchange
    # and merge covers every row. The kernels may decline a call (then None): the reference
    # path serves it, with the same single exchange, so ranks on different paths still meet
    # in the same collectives.
    local = None
    if fused is not None:
        local = fused.local_reduce(
            logits_chunk=call.logits_chunk,
            rows=rows,
            chunk_rows=step,
            shard=shard,
            target_ids_TW=target_ids_TW,
            inv_temperature_T=inv_temperature_T,
            keys_TN=keys_TN,
            top_k=top_k,
            want_entropy=want_entropy,
        )
    if local is None:
        chunks = [
            _local_reduce(
                req,
                call.logits_chunk(r0, min(rows, r0 + step)),
                target_ids_TW[r0 : r0 + step],
                inv_temperature_T[r0 : r0 + step],
                None if keys_TN is None else keys_TN[r0 : r0 + step],
            )
            for r0 in range(0, rows, step) or [0]  # one empty chunk for no rows
        ]
        local = LocalReduction(
            *(torch.cat(parts) for parts in list(zip(*chunks, strict=True))[:-1])
        )
    out, bad_T, over_T = _exchange(req, local, w)
    if over_T is None and fused is not None:
        over_T = torch.zeros(rows, dtype=torch.bool, device=device)

    def on_reference_path() -> HeadOutputs:
        return _run_chunks(call, allow_fused=False)

    # Both checks in one host read. A row the kernels could not finish (a huge tie at the top-k
    # threshold) may sit on any rank, so the ranks agree before all of them redo the call on the
    # reference path, collectives included. Without the kernels every rank merged the same
    # gathered data, so every rank raises (or not) together.
    over = over_T.any() if over_T is not None else torch.zeros((), dtype=torch.bool, device=device)
    flags = torch.stack([bad_T.any(), over]).to(torch.int32)
    if over_T is not None and tp_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=tp_group)
    if not deferred or tp_size > 1:
        settled = _settled(out, bad_T, flags, None, on_reference_path)
        return PendingHead(settled, lambda: settled) if deferred else settled
    done = None
    if device.type == "cuda":
        flags = flags.to("cpu", non_blocking=True)  # pinned: lands when `done` does
        done = torch.cuda.Event()
        done.record()
    return PendingHead(out, lambda: _settled(out, bad_T, flags, done, on_reference_path))


def _settled(
    out: HeadOutputs,
    bad_T: torch.Tensor,
    flags: torch.Tensor,
    done: torch.cuda.Event | None,
    on_reference_path: Callable[[], HeadOutputs],
) -> HeadOutputs:
    if done is not None:
        done.synchronize()
    any_bad, any_over = flags.tolist()
    if any_over:
        return on_reference_path()
    if any_bad:
        bad_rows = bad_T.nonzero().squeeze(1)
        raise ValueError(
            f"{bad_rows.numel()} rows have NaN or +inf logits, or no finite logit; first rows "
            f"{bad_rows[:8].tolist()}"
        )
    return out


@dataclass(frozen=True)
class PendingHead:
    """Head outputs the device may still be computing (`chunked_head(..., deferred=True)`).

    `out` holds the output tensors (read them only after `result()`, or in stream order on the
    device); `result()` waits for the device, checks every row, and returns `out`, or the
    outputs of the call redone on the reference path where the kernels could not finish a row.
    Raises ValueError as the call itself would have."""

    out: HeadOutputs
    _settle: Callable[[], HeadOutputs]

    def result(self) -> HeadOutputs:
        """The checked outputs (waits for the device)."""
        return self._settle()


@torch.no_grad()
def head_from_logits(
    *,
    logits_TV: torch.Tensor,
    shard: VocabShard,
    tp_group: dist.ProcessGroup | None,
    target_ids_TW: torch.Tensor | None,
    inv_temperature_T: torch.Tensor,
    top_k: int,
    sample_n: int,
    seed_T: torch.Tensor | None,
    position_T: torch.Tensor | None,
    want_entropy: bool,
    chunk_rows: int | None = None,
    comm: CommStats | None = None,
) -> HeadOutputs:
    """Teacher outputs from this rank's logits shard `logits_TV` ([T, shard.size], any float dtype).

    Every rank of `tp_group` (None: TP = 1) must call this with the same rows and arguments except
    its own logits. Rows are processed in chunks of `chunk_rows` (default: about
    DEFAULT_CHUNK_ELEMENTS / V), each upcast to fp32, so extra memory is O(chunk_rows x V).

    target_ids_TW: int64 [T, W] global ids in [0, vocab_size), or None for W = 0.
    inv_temperature_T: fp32 [T], 1 / temperature per row (see validate_temperature).
    top_k: K <= vocab_size; the top-K ids by descending probability, ties to the lowest id.
    sample_n: N; seed_T, position_T (int64 [T]) key the samples (see sampling_hash).
    want_entropy: also return the entropy of the tempered distribution.
    comm: optional CommStats that records the collectives.
    The per-row inputs may live on the logits' device or on the CPU. On the CPU their values
    are checked without a device sync and then copied over asynchronously, so a caller that
    keeps them on the host lets the device run ahead.

    Raises ValueError on inconsistent arguments, and on rows whose logits hold NaN or +inf.
    """
    if not logits_TV.is_floating_point() or logits_TV.dim() != 2:
        raise ValueError(
            f"logits_TV must be a 2-D float tensor, got {logits_TV.dtype} {tuple(logits_TV.shape)}"
        )
    call = _HeadCall(
        rows=logits_TV.shape[0],
        width=logits_TV.shape[1],
        device=logits_TV.device,
        logits_chunk=lambda r0, r1: logits_TV[r0:r1],
        shard=shard,
        tp_group=tp_group,
        target_ids_TW=target_ids_TW,
        inv_temperature_T=inv_temperature_T,
        top_k=top_k,
        sample_n=sample_n,
        seed_T=seed_T,
        position_T=position_T,
        want_entropy=want_entropy,
        chunk_rows=chunk_rows,
        comm=comm,
    )
    return _run_chunks(call)


@torch.no_grad()
def chunked_head(
    *,
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    shard: VocabShard,
    tp_group: dist.ProcessGroup | None,
    target_ids_TW: torch.Tensor | None,
    inv_temperature_T: torch.Tensor,
    top_k: int,
    sample_n: int,
    seed_T: torch.Tensor | None,
    position_T: torch.Tensor | None,
    want_entropy: bool,
    chunk_rows: int | None = None,
    comm: CommStats | None = None,
    deferred: bool = False,
) -> Any:  # HeadOutputs; PendingHead when deferred
    """Like head_from_logits, producing each chunk's logits as hidden_chunk @ weight_VH.T.

    hidden_TH: [T, H] final hidden states (replicated on the TP group); weight_VH: this rank's
    [shard.size, H] output-layer shard, same dtype. The matmul runs in that dtype and only one
    chunk of logits exists at a time, so the full [T, V] logits are never materialised.

    deferred: return a PendingHead as soon as the work is queued on the device, without
    waiting for it (at TP = 1; with a TP group the call completes first, as its checks need
    the group). The caller may queue more work before `result()`.
    """
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden_TH [T, H] and weight_VH [V, H] disagree: {tuple(hidden_TH.shape)} vs "
            f"{tuple(weight_VH.shape)}"
        )
    if hidden_TH.dtype != weight_VH.dtype or not hidden_TH.is_floating_point():
        raise ValueError(
            f"hidden_TH and weight_VH need one float dtype, got {hidden_TH.dtype} and "
            f"{weight_VH.dtype}"
        )
    if hidden_TH.device != weight_VH.device:
        raise ValueError(f"hidden_TH is on {hidden_TH.device}, weight_VH on {weight_VH.device}")
    weight_HV = weight_VH.t()
    call = _HeadCall(
        rows=hidden_TH.shape[0],
        width=weight_VH.shape[0],
        device=hidden_TH.device,
        logits_chunk=lambda r0, r1: hidden_TH[r0:r1] @ weight_HV,
        shard=shard,
        tp_group=tp_group,
        target_ids_TW=target_ids_TW,
        inv_temperature_T=inv_temperature_T,
        top_k=top_k,
        sample_n=sample_n,
        seed_T=seed_T,
        position_T=position_T,
        want_entropy=want_entropy,
        chunk_rows=chunk_rows,
        comm=comm,
    )
    return _run_chunks(call, deferred=deferred)
