"""The experts' two GEMMs through quack-kernels, where that optional package is installed.

quack-kernels (`pip install teacherq[hopper]`) holds GEMMs written in CUTLASS's CuTe DSL for
Hopper: warp-specialized, TMA loads and stores, wgmma. Its varlen-M GEMM multiplies rows sorted
by expert (`cu_seqlens_m`: each expert's first row) by that expert's weights in one launch;
its gated variant applies SwiGLU to the gate and up products before it stores. At
DeepSeek-V3's experts (16384 tokens, H100, docs/benchmarks.md) against our Triton kernels:

    gate/up + SwiGLU   12.7 ms on rows gathered beforehand (13.9 with the gather pass),
                       15.4-15.7 gathering in the kernel, ours 15.7-16.0 (Hopper's TMA
                       cannot gather, so a gathering kernel loads its rows with plain loads)
    down               6.1-6.9 ms into rows in expert order (ours, which also multiplies by
                       the routing weight and scatters to [token, choice] rows: 8.5)

So `gate_up` gathers the rows in one pass first (where rows are wide enough for that to pay,
`takes_gate_up`; narrower ones keep our gate/up kernel), and `down`'s rows stay in expert order:
`consumer/kernels/moe_combine.py` then sums each token's rows with their weights, in the pass
the scatter path spends on its sum over k. `moe_gemm.routed_combined` puts them together.

Used on sm90 for bf16 experts, after a check against torch on the device at the experts' width
(`available`);
FP8 experts and other devices keep the Triton kernels. The tiles are pinned: quack's
autotuner keys on the exact row count, which changes with every batch.

quack compiles a GEMM for symbolic sizes: one kernel per tile, dtype and layout serves every
shape. A consumer's precompile workers compile the two the experts reach (`precompile_plan`,
`precompile`) into QUACK_CACHE_DIR while the weights load, so that its warm-up only loads them;
the probe runs the same two.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import tempfile
import threading
from typing import Any

import structlog
import torch

log = structlog.get_logger("teacherq.consumer")

# 192 x 128 rows by columns, ping-pong warp groups, a cluster of 2 along N: what quack's
# autotuner chose at DeepSeek-V3's experts for both GEMMs (H100). Gate/up takes it at every
# width; down from WIDE_N output columns
TILE = {"tile_m": 192, "tile_n": 128, "pingpong": True, "cluster_m": 1, "cluster_n": 2}
# DeepSeek-V3's down GEMM (7168 x 2048) ran 6.1 ms on TILE against 6.7 on quack's default
# 128 x 192; GLM-4.5-Air's and Qwen3-30B-A3B's ran fastest on the default (H100,
# docs/benchmarks.md)
WIDE_N = 6144
# Hidden sizes from which gate/up runs through quack too. H100, 16384 tokens, the gather pass
# included, against our Triton gate/up (which gathers its rows itself): DeepSeek-V3 (7168)
# 13.9 ms against 16.0, GLM-4.5-Air (4096) 5.48 against 5.65; at Qwen3-30B-A3B's 2048 the
# two traded places between machines (1.76 against 1.56, then 1.55 against 1.62), and ours
# keeps it (docs/benchmarks.md)
UP_MIN_HIDDEN = 4096


# `consumer.expert_gemms`: "triton" turns this path off for the process (`allow`)
_allowed = True
# the import threads `preload` started and `settle` has not waited for yet
_preloading: list[threading.Thread] = []


def allow(enabled: bool) -> None:
    """Let quack serve the experts in this process (the default) or not (`consumer.expert_gemms
    = triton`: the Triton kernels always, and quack neither imported nor compiled for). Set
    before the model is built: what `available` and `preload` decided is forgotten."""
    global _allowed
    _allowed = enabled
    available.cache_clear()
    preload.cache_clear()


def installed() -> bool:
    """Whether quack-kernels imports here (the `hopper` extra)."""
    return importlib.util.find_spec("quack") is not None


@functools.cache
def available(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether the experts' GEMMs run through quack on `device` for experts in `dtype` whose
    down projection writes `width` columns (the model's hidden size): bf16, an sm90 device,
    quack installed, and both GEMMs' result on a small case (an expert with no rows among
    them, down at `width`, so on the tile that serves it: `down_config`) matching a float32
    loop. Checked once per device, dtype and width."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not may_serve(device):
        return False
    try:
        return _probe(device, dtype, width)
    except Exception as exc:  # noqa: BLE001 - another library's build: fall back, never fail
        log.debug("quack_gemm_unavailable", error=f"{type(exc).__name__}: {exc}")
        return False


def _tile() -> Any:
    from quack.gemm_config import GemmConfig

    return GemmConfig(is_dynamic_persistent=False, **TILE)


def may_serve(device: torch.device | None = None) -> bool:
    """Whether `available` may accept CUDA `device` (default: the current one): quack
    allowed (`allow`), installed, and the device sm90. Asked without a CUDA context (also the
    precompile workers' question: what to compile); `available` then checks a small case on
    the device."""
    if not _allowed or not installed() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


@functools.cache
def preload(device: torch.device) -> threading.Thread | None:
    """Import quack's GEMM interface on a daemon thread, once per process and device, where
    `may_serve` accepts `device`: what `build_model` starts for a bf16 MoE teacher, so that
    the import (the CuTe DSL's modules; 3-4 s after torch on a 2-core host) runs while the
    weights load (reads and copies that mostly release the GIL) instead of in the warm-up's
    first forward. Returns the thread (None where quack cannot serve); a failed import is
    logged at debug level, and the first forward's own import then raises or falls back as
    before. `settle` waits for it."""
    if device.type != "cuda" or not may_serve(device):
        return None
    thread = threading.Thread(target=_import_interface, name="tq-quack-import", daemon=True)
    thread.start()
    _preloading.append(thread)
    return thread


def settle(timeout_s: float = 120.0) -> None:
    """Wait for the imports `preload` started: the consumer calls this before its warm-up,
    whose first forward imports parts of torch lazily, so that no two threads import at once
    while it runs (two imports entering a cycle of modules from both ends fail one of them)."""
    while _preloading:
        _preloading.pop().join(timeout_s)


def _import_interface() -> None:
    try:
        importlib.import_module("quack.gemm_interface")
    except Exception as exc:  # noqa: BLE001 - another library's build: `available` decides
        log.debug("quack_gemm.preload_failed", error=f"{type(exc).__name__}: {exc}")


def takes_rows(hidden: int, ffn: int) -> bool:
    """Whether quack's GEMMs take experts of `hidden` x `ffn` in bf16: rows of whole 16-byte
    units (TMA's step). Narrower ones keep the Triton kernels."""
    return hidden % 8 == ffn % 8 == 0


def takes_gate_up(hidden: int) -> bool:
    """Whether gate/up runs through quack (`gate_up`) for rows of `hidden`, else through our
    Triton kernel, which gathers its rows itself."""
    return hidden >= UP_MIN_HIDDEN


def down_config(n: int, device: torch.device) -> Any:
    """The down projection's tile for N output columns on `device`: TILE from DeepSeek-V3's
    width on, quack's default below."""
    from quack.gemm_interface import default_config

    return _tile() if n >= WIDE_N else default_config(device)


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """Each expert's first row, and the total, int32 [E + 1] (quack's `cu_seqlens_m`)."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def gate_up(x: torch.Tensor, tokens: torch.Tensor, fc1: torch.Tensor, starts: torch.Tensor):
    """h [R, f] = silu(x[tokens[i]] @ gate_e^T) * (x[tokens[i]] @ up_e^T) for rows sorted by
    expert (`starts` = `offsets(counts)`), fc1 [E, 2f, K] = [gate; up] rows. The rows are
    gathered first (one pass) so that the GEMM reads them through TMA; SwiGLU runs on the
    float32 products, rounded once."""
    from quack.gemm_interface import gemm_gated

    rows = x.index_select(0, tokens)
    return gemm_gated(
        rows, fc1.mT, activation="swiglu", cu_seqlens_m=starts, concat_layout=("B",),
        store_preact=False, tuned=False, config=_tile(),
    )[1]  # fmt: skip


def down(h: torch.Tensor, fc2: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """y [R, N] = h[i] @ fc2[e]^T for the R rows of h sorted by expert (`starts` =
    `offsets(counts)`), fc2 [E, N, f] (rows contiguous); y in h's dtype, in the same order."""
    from quack.gemm_interface import gemm_tuned

    y = torch.empty(h.shape[0], fc2.shape[1], dtype=h.dtype, device=h.device)
    if h.shape[0]:
        # gemm_tuned's undecorated function: one pinned tile, no autotuning (quack's own
        # `gemm(..., tuned=False)` calls it so, with its default tile)
        config = down_config(fc2.shape[1], h.device)
        gemm_tuned.fn(h, fc2.mT, y, cu_seqlens_m=starts, config=config)
    return y


def precompile_plan(hidden: int) -> list[dict[str, Any]]:
    """The compiles that experts of `hidden` columns reach, and `available`'s probe at their
    width with them, each as `precompile`'s keyword arguments: gate/up (one kernel for every
    width) and down into `hidden` columns (on `down_config`'s tile for that width)."""
    return [{"gemm": "gate_up"}, {"gemm": "down", "n": hidden}]


class _Recorded:
    """Stands in for quack's compile pool (quack/cache/async_compile.py) while a call runs on
    meta tensors. On a key its cache lacks, quack's `jit_cache` hands the compile function and
    its arguments to the pool's `submit` and raises `CompilePending`, before anything asks the
    device: the calls are recorded here, then compiled in this process."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple, dict]] = []

    def poll(self, _sha: str) -> tuple[str, None]:
        return "new", None

    def mark_external(self, _sha: str, _o_path: str, _lock_path: str) -> None:
        """Another process compiles this key: nothing to record."""

    def submit(self, _sha: str, fn: Any, args: tuple, kwargs: dict, _o_path: Any) -> bool:
        self.calls.append((fn, args, kwargs))
        return True


def precompile(gemm: str, dtype: torch.dtype, n: int = 0, *, anywhere: bool = False) -> None:
    """Compile `gemm` ("gate_up", or "down" into `n` columns) into quack's cache
    (QUACK_CACHE_DIR) as the probe's and the experts' calls would reach it, launching nothing
    and creating no CUDA context: what the precompile workers run, each in a fresh process
    (consumer/serve/precompile.py). Nothing to do where `available` would decline (not bf16,
    no sm90 device).

    The call runs on meta tensors, with quack's compile pool stood in for by `_Recorded` and
    its cache pointed at an empty folder, so that it stops at the compile whether or not the
    kernel is cached already. Each recorded compile then runs through quack's cached compile
    function (found by module and name, as quack's own pool workers find it) against the
    real cache: it compiles and writes the kernel's `.o`, or loads the one there.

    `anywhere`: compile for sm90 whatever this machine's device, where quack is installed and
    allowed (a bake on a machine without a GPU, consumer/serve/bake.py)."""
    if dtype != torch.bfloat16 or not (may_serve() or (anywhere and _allowed and installed())):
        return
    # quack reads the architecture from QUACK_ARCH where it cannot ask a meta tensor's device,
    # and the CuTe DSL compiles for CUTE_DSL_ARCH: both the device's, set before the import
    os.environ.setdefault("QUACK_ARCH", "90")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import quack.cache
    from quack.cache import async_compile

    def meta(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    starts = meta(4, dtype=torch.int32)
    recorded, pool, cache_dir = _Recorded(), async_compile._active_pool, quack.cache.CACHE_DIR
    with tempfile.TemporaryDirectory(prefix="tq-quack-") as empty:
        async_compile._active_pool, quack.cache.CACHE_DIR = recorded, empty
        try:
            if gemm == "gate_up":
                gate_up(meta(32, 256), meta(64, dtype=torch.int64), meta(3, 256, 256), starts)
            elif gemm == "down":
                down(meta(64, 256), meta(3, n, 256), starts)
            else:
                raise ValueError(f"gemm must be 'gate_up' or 'down', got {gemm!r}")
        except async_compile.CompilePending:
            pass
        finally:
            async_compile._active_pool, quack.cache.CACHE_DIR = pool, cache_dir
    if not recorded.calls:
        raise RuntimeError(f"quack's {gemm} GEMM reached no compile on meta tensors")
    for fn, args, kwargs in recorded.calls:
        cached: Any = importlib.import_module(fn.__module__)
        for part in fn.__qualname__.split("."):
            cached = getattr(cached, part)
        cached(*args, **kwargs)  # quack's jit_cache: compiles and writes the .o, or loads it


def _probe(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    counts = torch.tensor([40, 0, 24], device=device)
    x = torch.randn(32, 256, device=device, dtype=dtype, generator=gen)
    tokens = torch.randint(0, 32, (64,), device=device, generator=gen)
    fc1 = (torch.randn(3, 256, 256, device=device, generator=gen) / 16).to(dtype)
    fc2 = (torch.randn(3, width, 128, device=device, generator=gen) / 16).to(dtype)
    starts = offsets(counts)
    h = gate_up(x, tokens, fc1, starts)
    got = down(h, fc2, starts).float()
    want = []
    for e, (first, last) in enumerate(((0, 40), (40, 40), (40, 64))):
        gate, up = (x[tokens[first:last]].float() @ fc1[e].float().T).chunk(2, dim=-1)
        want.append((torch.nn.functional.silu(gate) * up) @ fc2[e].float().T)
    return bool(torch.allclose(got, torch.cat(want), rtol=2e-2, atol=2e-2))
