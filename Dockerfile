# teacherq image: GPU consumers (`python -m consumer`, `torchrun ... -m consumer`), the rq worker
# and the `teacherq` CLI all run from it (see docker-compose.yml).
#
#   docker build -t teacherq:latest .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<tag> -t teacherq:latest .
#
# The base image brings CUDA, cuDNN, NCCL and a CUDA build of torch; teacherq's other
# dependencies are installed around that torch, never replacing it. torchrun honours
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (the TP drain window) from torch 2.12 on.
ARG BASE_IMAGE=pytorch/pytorch:2.12.1-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1

WORKDIR /opt/teacherq

# Dependencies get their own layer, keyed on pyproject.toml alone: editing the source does not
# reinstall them. torch is left out of the list and pinned by a constraint to the version the
# base image ships, so that no dependency can pull a second (multi-GB) torch build.
# The image runs consumers and the rq worker: the base dependencies plus the `consumer`,
# `hopper` (quack-kernels: MoE experts on sm90; inert elsewhere), `datasets` and `otel` extras.
COPY pyproject.toml ./
RUN python -c "import re, tomllib; \
p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = p['optional-dependencies']; \
deps = p['dependencies'] + extras['consumer'] + extras['hopper'] + extras['datasets'] + extras['otel']; \
print('\n'.join(d for d in deps if re.split(r'[\s<>=!~;\[]', d, maxsplit=1)[0] != 'torch'))" \
        > /tmp/requirements.txt \
    && python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
        > /tmp/constraints.txt \
    && python -m pip install -r /tmp/requirements.txt -c /tmp/constraints.txt \
    && rm /tmp/requirements.txt /tmp/constraints.txt

# The project itself, without dependencies (all present above).
COPY . .
RUN python -m pip install --no-deps . \
    && rm -rf build ./*.egg-info

# Bytecode for everything installed, the base image's torch included: with
# PYTHONDONTWRITEBYTECODE set and an unprivileged user, none is written at run time, and every
# consumer start would compile torch's thousands of sources again (an H200 host without it:
# 11.8 s to import the consumer; with it, 5.0 s). Some packages ship sources that are not
# meant to compile (test fixtures): compileall reports them and they stay as they are.
RUN python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    || echo "compileall: some files were left without bytecode (see above)"

# Run as an unprivileged user; /work is its writable working directory (relative paths such as
# the default ./.teacherq land there).
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin teacherq \
    && mkdir -p /work /var/cache/teacherq/compile \
    && chown -R teacherq:teacherq /work /var/cache/teacherq
USER teacherq
WORKDIR /work

# No ENTRYPOINT: compose's `command:` (consumer, torchrun, `teacherq worker`) runs as given.
CMD ["python", "-m", "consumer"]
