"""The client-only install: `pip install teacherq` declares no torch, megatron-core, pyarrow or
rq, and the whole client path (sync and asyncio clients, the gateway, the CLI) imports and runs
against a real valkey-server in a process where importing any of them fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from shared.settings import to_env
from tests.helpers import REPO

HEAVY = ("torch", "megatron", "pyarrow", "rq", "triton", "transformers")

# Installed first in the child: any import of a HEAVY package (or its submodules) raises
# ModuleNotFoundError, exactly as in an environment that never installed it.
BLOCKER = f"""
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""

CLIENT_RUN = """
import asyncio, runpy
import producer, producer.aio, producer.client, producer.gateway, producer.protocol
import producer.cli, producer.status, producer.progress
from producer import AsyncTeacherClient, TeacherClient, TeacherRequest
from tests.timing import scaled

ids = TeacherClient().submit([TeacherRequest(input_ids=[1, 2, 3])])

async def main():
    async with AsyncTeacherClient() as client:
        assert await client.submit([TeacherRequest(input_ids=[1, 2, 3])]) == ids
        await client.cancel(ids[0])
        [res] = await client.wait(ids, timeout=scaled(10))
        assert res.error == "cancelled by the user", res

asyncio.run(main())
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r} + ("consumer",))
assert not heavy, heavy
print("client ok")
"""


def _deps() -> tuple[list[str], dict[str, list[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"], project["optional-dependencies"]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower()


def test_base_install_declares_no_heavy_dependency_and_every_one_is_capped() -> None:
    """The base dependencies are the client's: none of torch, megatron-core, pyarrow, rq; those
    sit in the `consumer` and `datasets` extras; every requirement has an upper bound."""
    base, extras = _deps()
    assert not {_name(d) for d in base} & {"torch", "megatron-core", "pyarrow", "rq"}
    assert {"torch", "megatron-core"} <= {_name(d) for d in extras["consumer"]}
    assert {"pyarrow", "rq"} <= {_name(d) for d in extras["datasets"]}
    for req in base + [d for group in extras.values() for d in group]:
        if _name(req) == "teacherq":  # an extra naming others (dev pulls every extra)
            continue
        assert "<" in req or "==" in req, f"{req!r} has no upper bound"
    # `make test` and `make demo` install `.[dev]` (with the extras named too): everything.
    assert "teacherq[consumer,datasets,otel]" in extras["dev"]
    for package in ("producer", "shared", "consumer"):
        assert (REPO / package / "py.typed").exists()


@pytest.mark.integration
def test_client_path_runs_with_heavy_packages_missing(settings) -> None:
    """With torch, megatron, pyarrow, rq (and triton, transformers) unimportable, the client
    modules import, submit/cancel/wait work against a real valkey-server from both clients,
    none of those packages (nor `consumer`) ends up loaded, `teacherq --version` and `--help`
    work and `teacherq consumer` says which extra to install."""
    env = {**os.environ, **to_env(settings), "PYTHONPATH": str(REPO)}
    code = BLOCKER + CLIENT_RUN.format(heavy=HEAVY)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("client ok")
    for args, rc, want in (
        (["--version"], 0, "teacherq "),
        (["--help"], 0, "serve"),
        (["consumer"], 2, "pip install 'teacherq[consumer]'"),
    ):
        cli = BLOCKER + f"import sys; sys.argv = ['teacherq', *{args!r}]\n"
        cli += "from producer.cli import main; main()"
        out = subprocess.run([sys.executable, "-c", cli], env=env, capture_output=True, text=True)
        assert out.returncode == rc, (args, out.stdout, out.stderr[-2000:])
        assert want in out.stdout + out.stderr, (args, out.stdout, out.stderr[-2000:])
