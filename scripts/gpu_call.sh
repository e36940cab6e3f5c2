#!/usr/bin/env bash
# One call on a lent GPU machine without network (docs/development.md, "GPU runs"): unpack the
# dependencies carried in .whl/ beside the repository, compile their bytecode, then run each
# argument as a command, in order, from the repository root, each one's output into its own
# log under $OUT (or ./gpu-out). A command that fails is reported and the next one still runs;
# the exit status is the number of commands that failed.
#
#     make gpu-carry-hopper                      # here, once: .whl/*.whl and .whl/hopper/*.tar.xz
#     # there:
#     bash scripts/gpu_call.sh \
#       "python -m pytest -q tests/gpu/test_quack_gemm.py tests/gpu/test_precompile.py" \
#       "python bench/cold_start.py --model deepseek-v3-1s --fast-write --parts none --starts cold,warm --drop-page-cache"
#
# Where the carry holds the two tarballs (`make gpu-carry-hopper`), they are unpacked into one
# folder named site-packages (quack treats only libraries under such a folder as fixed when it
# fingerprints a kernel) and put on PYTHONPATH with the CuTe DSL's packages; otherwise the
# wheels in .whl/ are installed with pip. Bytecode is compiled for them and for the image's
# own site-packages first: without it every process compiles its imports' sources on each
# start (run 16 of docs/benchmarks.md lost 8-10 s of each start so).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
deps=${TEACHERQ_GPU_DEPS:-/tmp/teacherq-deps}/site-packages
python=${PYTHON:-python}

if [ -f .whl/hopper/rest.tar.xz ] && [ -f .whl/hopper/libs.tar.xz ]; then
    mkdir -p "$deps"
    tar -C "$deps" -xJf .whl/hopper/rest.tar.xz
    tar -C "$deps" -xJf .whl/hopper/libs.tar.xz
    export PYTHONPATH="$PWD:$deps:$deps/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
elif compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps .whl/*.whl
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
purelib=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
targets=("$purelib")
[ -d "$deps" ] && targets+=("$deps")
"$python" -m compileall -q -j 0 "${targets[@]}" >"$out/compileall.log" 2>&1 || true
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    "$python" -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)' 2>&1
} >"$out/machine.txt"

failed=0
i=0
for command in "$@"; do
    i=$((i + 1))
    log="$out/$(printf '%02d' "$i").log"
    echo "\$ $command" >"$log"
    start=$(date +%s)
    if bash -c "$command" >>"$log" 2>&1; then
        status=0
    else
        status=$?
        failed=$((failed + 1))
    fi
    echo "[$i] exit $status after $(($(date +%s) - start)) s: $command" | tee -a "$out/summary.txt"
done
exit "$failed"
