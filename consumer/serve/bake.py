"""Compile a consumer's kernels ahead of time, without a GPU: a seed for its compile cache.

A fresh machine's first start compiles every kernel variant its warm-up reaches (the
precompile workers, consumer/serve/precompile.py): seconds at 1.5B, and quack-kernels' GEMMs
19-24 s in a worker (docs/benchmarks.md). What Triton compiles depends on the kernel's
source and specialization, Triton's release (with the ptxas it bundles) and the GPU's
architecture, not on the GPU itself, and its cache key says as much: compiled for an sm90
target here, a kernel has the key an H100 or H200 computes for it. So where the image is
built:

    TEACHERQ_MODEL__PATH=/models/teacher python -m consumer.serve.bake /var/cache/teacherq/seed

compiles every variant that the precompile workers of a consumer with these settings (the
TEACHERQ_* environment: the model's config.json, TP and EP sizes, dtype, queue limits, token
budget, expert GEMMs, FP8) would compile on any of its tensor-parallel ranks, for sm90, into
DIR/triton and, where quack-kernels is installed, DIR/quack, then records them in DIR/seed.json
(what compiled them and a checksum per file). Only the checkpoint's config.json is read
(`--config` names another folder holding one). A consumer started with
TEACHERQ_CONSUMER__COMPILE_CACHE_SEED=DIR copies them into a compile cache that is not sealed
yet (`compile_cache.seed`), where its precompile workers and warm-up find them. The kernels'
host-side launchers are left to the workers: they link against the CUDA driver.

Exit status 0 when every variant compiled, 1 when some failed (each named on stderr), 78 for
bad settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

SM90 = 90  # H100, H200: the architecture the seed is compiled for


def bake_plan(settings: Any, config_dir: str | None) -> list[Any]:
    """The variants the precompile workers of a consumer with `settings` would compile on an
    sm90 GPU, over every tensor-parallel rank, each once; `config_dir`: a folder with the
    model's config.json (None: the tiny preset)."""
    from consumer.serve.precompile import Job, job_plan

    variants: dict[Any, None] = {}
    for tp_rank in range(settings.parallel.tp):
        job = Job.for_settings(settings, tp_rank=tp_rank, workers=1, model_path=config_dir)
        variants |= dict.fromkeys(job_plan(job, sm90=True))
    return list(variants)


def bake(out: Path, variants: list[Any]) -> list[str]:
    """Compile `variants` for sm90 into `out`'s triton/ and quack/ (the environment variables
    point there before Triton reads them) and record the seed; returns one line per failed
    variant."""
    from consumer.forward import quack_gemm
    from consumer.kernels import launch
    from consumer.serve import compile_cache
    from consumer.serve.precompile import compile_variant

    launch.stand_in_driver(SM90)
    launch.without_launchers()
    failed = []
    for variant in variants:
        try:
            if variant.kernel == "quack_gemm":
                quack_gemm.precompile(**dict(variant.params), anywhere=True)
            else:
                compile_variant(variant)
        except Exception as exc:  # noqa: BLE001 - reported per variant; the consumer compiles it
            failed.append(f"{variant.name()}: {type(exc).__name__}: {str(exc)[:300]}")
    key = compile_cache.environment_key()
    names = sorted(v.name() for v in variants)
    compile_cache.write_seed_record(out, key, capability=SM90, variants=names)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m consumer.serve.bake", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", type=Path, help="the seed's folder (created)")
    parser.add_argument(
        "--config",
        help="a folder with the model's config.json (default: TEACHERQ_MODEL__PATH)",
    )
    parser.add_argument(
        "--kernel", action="append", help="only this kernel module's variants (repeatable)"
    )
    args = parser.parse_args(argv)
    from shared.exitcodes import CONFIG
    from shared.settings import SettingsError, load_settings

    try:
        settings = load_settings()
    except SettingsError as exc:
        sys.stderr.write(f"teacherq bake: {exc}\n")
        return CONFIG
    config = args.config or (None if settings.model.path is None else str(settings.model.path))
    if config is not None and not (Path(config) / "config.json").is_file():
        option = "--config" if args.config else "TEACHERQ_MODEL__PATH"
        sys.stderr.write(f"teacherq bake: {option}: no config.json in {config}\n")
        return CONFIG
    out = args.out.resolve()
    for variable, sub in (("TRITON_CACHE_DIR", "triton"), ("QUACK_CACHE_DIR", "quack")):
        (out / sub).mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(out / sub)  # before Triton or quack is imported
    os.environ.setdefault("QUACK_ARCH", str(SM90))
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    began = time.monotonic()
    from consumer.checkpoints.validate import CheckpointError

    try:
        planned = bake_plan(settings, config)
    except (CheckpointError, ValueError) as exc:  # a config.json the consumer would refuse
        sys.stderr.write(f"teacherq bake: {config}/config.json: {exc}\n")
        return CONFIG
    variants = [v for v in planned if not args.kernel or v.kernel in args.kernel]
    failed = bake(out, variants)
    for line in failed:
        sys.stderr.write(f"teacherq bake: failed: {line}\n")
    sys.stderr.write(
        f"teacherq bake: {len(variants) - len(failed)} of {len(variants)} variants compiled for "
        f"sm{SM90} into {out} in {time.monotonic() - began:.1f} s\n"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
