"""Operating teacherq without a consumer: what the CLI and the client answer to routine
mistakes (issue 20). Real valkey-server, the real `teacherq` CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer import InvalidJob, JobFailed, TeacherClient, TeacherRequest
from shared import exitcodes, keys
from shared.errors import UnknownJob
from shared.settings import to_env
from tests.helpers import error_lines
from tests.processes import run_cli as cli
from tests.processes import run_with_terminal_stderr
from tests.timing import scaled

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


# -- unknown job ids ------------------------------------------------------------------------


def test_cancel_of_unknown_id_is_an_error_and_creates_nothing(settings, r) -> None:
    """`cancel j-doesnotexist` exits 2 naming the id, and writes no record or completion."""
    proc = cli(settings, "cancel", "j-doesnotexist")
    assert proc.returncode == exitcodes.USAGE, proc.stderr
    assert "j-doesnotexist" in proc.stderr and "unknown job id" in proc.stderr
    assert len(error_lines(proc)) <= 2
    q = settings.queue.name
    assert not r.exists(keys.result_key(q, "j-doesnotexist"))
    assert r.xlen(keys.done_stream(q)) == 0


def test_results_and_wait_of_unknown_ids_raise(settings) -> None:
    """`results` of a typo exits 2 (not "pending"); `wait` without a timeout raises
    UnknownJob at once instead of blocking forever; known pending ids still read as pending."""
    proc = cli(settings, "results", "j-typo")
    assert proc.returncode == exitcodes.USAGE and "j-typo" in proc.stderr
    client = TeacherClient(settings)
    [known] = client.submit([TeacherRequest(input_ids=[1, 2, 3])])
    t0 = time.monotonic()
    with pytest.raises(UnknownJob, match="j-typo"):
        client.wait([known, "j-typo"])
    assert time.monotonic() - t0 < scaled(5)
    with pytest.raises(UnknownJob):
        client.cancel("j-typo")
    assert client.results([known]) == [None]
    pending = cli(settings, "results", known)
    assert pending.returncode == exitcodes.NOT_DONE and '"pending"' in pending.stdout


# -- one exception family -------------------------------------------------------------------


def test_request_errors_are_invalid_job_everywhere(settings) -> None:
    """TeacherRequest(...) with a misspelled field raises InvalidJob (not pydantic's
    ValidationError) naming the field, as submit does."""
    with pytest.raises(InvalidJob, match="topk"):
        TeacherRequest(input_ids=[1, 2, 3], topk=4)
    with pytest.raises(InvalidJob, match="topk"):
        TeacherClient(settings).submit([{"input_ids": [1, 2, 3], "topk": 4}])


def test_failed_job_raises_job_failed_and_results_exits_1(settings) -> None:
    """wait(raise_on_error=True) raises JobFailed for a failed (here cancelled) job; without
    it the failure comes back as a result; `teacherq results` of it exits 1."""
    client = TeacherClient(settings)
    [job] = client.submit([TeacherRequest(input_ids=[4, 5, 6])])
    client.cancel(job)
    with pytest.raises(JobFailed, match="cancelled") as info:
        client.wait([job], raise_on_error=True)
    assert info.value.job_id == job
    [res] = client.wait([job])
    assert not res.ok
    proc = cli(settings, "results", job, "--json")
    assert proc.returncode == exitcodes.FAILED
    assert json.loads(proc.stdout.splitlines()[0])["error"].startswith("cancelled")


# -- CLI errors -----------------------------------------------------------------------------


def test_redis_unreachable_names_the_setting(settings, tmp_path) -> None:
    """An unreachable Redis is a two-line error naming TEACHERQ_REDIS__URL, exit 69; the
    traceback only with --debug."""
    dead = settings.model_copy(
        update={"redis": settings.redis.model_copy(update={"url": "redis://127.0.0.1:9/0"})}
    )
    proc = cli(dead, "status", "--json")
    assert proc.returncode == exitcodes.UNAVAILABLE, proc.stderr
    lines = error_lines(proc)
    assert 1 <= len(lines) <= 2 and "TEACHERQ_REDIS__URL" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    debug = cli(dead, "--debug", "status", "--json")
    assert debug.returncode == exitcodes.UNAVAILABLE and "Traceback" in debug.stderr


def test_broken_config_file_names_file_line_and_field(tmp_path) -> None:
    """A config file that does not parse names the file and line; a bad field names the
    file and the field; both exit 78."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("queue:\n  name: a\n   max_top_k: [\n")
    proc = cli(None, "status", env={"TEACHERQ_CONFIG": str(bad_yaml)})
    assert proc.returncode == exitcodes.CONFIG, proc.stderr
    assert str(bad_yaml) in proc.stderr and ":3" in proc.stderr
    assert len(error_lines(proc)) <= 2 and "Traceback" not in proc.stderr
    bad_field = tmp_path / "field.yaml"
    bad_field.write_text("model:\n  dtype: fp8\n")
    proc = cli(None, "status", env={"TEACHERQ_CONFIG": str(bad_field)})
    assert proc.returncode == exitcodes.CONFIG
    assert str(bad_field) in proc.stderr and "model.dtype" in proc.stderr
    assert len(error_lines(proc)) <= 2


def test_submit_reads_stdin_and_names_bad_lines(settings) -> None:
    """`submit -` reads JSONL from stdin; a bad line is named by its number, with the
    field, and nothing is enqueued (exit 2)."""
    good = json.dumps({"input_ids": [1, 2, 3], "job_id": "from-stdin"})
    proc = cli(settings, "submit", "-", stdin=good + "\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["from-stdin"]
    bad = (
        good.replace("from-stdin", "second") + "\n\n" + json.dumps({"input_ids": [1, 2], "topk": 4})
    )
    proc = cli(settings, "submit", "-", stdin=bad + "\n")
    assert proc.returncode == exitcodes.USAGE
    assert "<stdin>:3" in proc.stderr and "topk" in proc.stderr
    assert len(error_lines(proc)) <= 2
    assert TeacherClient(settings).results(["second"], strict=False) == [None]
    missing = cli(settings, "submit", "no-such-file.jsonl")
    assert missing.returncode == exitcodes.USAGE and "no-such-file.jsonl" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_every_wait_times_out_with_the_same_code(settings, tmp_path) -> None:
    """With no consumer, `submit --wait` and `results --wait` give up with exit 3 (as
    `submit-dataset --wait` does), in one line."""
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps({"input_ids": [7, 8, 9]}) + "\n")
    proc = cli(settings, "submit", str(f), "--wait", "--timeout", "0.5")
    assert proc.returncode == exitcodes.NOT_DONE, proc.stderr
    assert "timed out" in proc.stderr and len(error_lines(proc)) <= 2
    job = proc.stdout.split()[0]
    proc = cli(settings, "results", job, "--wait", "--timeout", "0.5")
    assert proc.returncode == exitcodes.NOT_DONE


# -- a quiet library ------------------------------------------------------------------------

_TRAINER = """
import sys
from producer import TeacherClient, TeacherRequest
client = TeacherClient()
ids = client.submit([TeacherRequest(input_ids=[1, 2, 3, i]) for i in range(5)])
client.cancel(ids[0])
client.wait(ids[:1])
print("trainer-output")
"""


@pytest.mark.parametrize("level", [None, "warning", "debug"])
def test_client_never_writes_stdout_and_obeys_the_level(settings, level) -> None:
    """A trainer's stdout holds only its own output whatever TEACHERQ_LOG__LEVEL says; the
    client's logs go to stderr, at debug only when asked (none by default or at warning)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEACHERQ_")}
    env.update(to_env(settings), PYTHONPATH=str(REPO))
    env.pop("TEACHERQ_LOG__LEVEL", None)
    if level:
        env["TEACHERQ_LOG__LEVEL"] = level
    proc = subprocess.run(
        [sys.executable, "-c", _TRAINER],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "trainer-output\n"
    if level == "debug":
        assert '"submit.start"' in proc.stderr
    else:
        assert proc.stderr == ""


def test_submit_dataset_rejects_a_misspelled_field_like_submit(settings, tmp_path, r) -> None:
    """A dataset whose line 2 carries `"topk"` is refused at once (exit 2) naming the file,
    the line and the field with its likely fix, and no dataset is created; the same field is
    rejected by `submit`. A column named with --keep-field is accepted."""
    src = tmp_path / "rows.jsonl"
    src.write_text(
        json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": [1, 2], "topk": 4})
    )
    proc = cli(settings, "submit-dataset", str(src), "--output", str(tmp_path / "out"))
    assert proc.returncode == exitcodes.USAGE, proc.stderr
    assert f"{src}:2" in proc.stderr and "'topk' (did you mean 'top_k'?)" in proc.stderr
    assert len(error_lines(proc)) <= 2
    assert not r.exists(keys.datasets_index_key(settings.queue.name))
    proc = cli(settings, "submit", str(src))
    assert proc.returncode == exitcodes.USAGE and f"{src}:2" in proc.stderr
    assert "topk" in proc.stderr
    kept = cli(
        settings,
        "submit-dataset",
        str(src),
        "--output",
        str(tmp_path / "o"),
        "--keep-field",
        "topk",
    )
    assert kept.returncode == 0, kept.stderr


def _fake_hf(path: Path) -> Path:
    """A directory the CLI's probe accepts (config.json of a served family, a safetensors
    file); only a consumer would find it empty."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_update_without_consumers_never_blocks_the_next(settings, tmp_path, r) -> None:
    """With no live consumer an update is recorded for the next consumer to start and the
    CLI says so (exit 0, no wait); an update left running by consumers that died no longer
    refuses the next one."""
    from shared.weights import current, request_update

    a, b = _fake_hf(tmp_path / "a"), _fake_hf(tmp_path / "b")
    q = settings.queue.name
    request_update(r, q, str(a))  # as if its consumers died mid-update
    t0 = time.monotonic()
    proc = cli(settings, "update-weights", str(b))
    assert proc.returncode == 0, proc.stderr
    assert "no live consumer" in proc.stdout and time.monotonic() - t0 < scaled(30)
    w = current(r, q)
    assert (w.path, w.generation, w.state) == (str(b), 2, "updating")
    proc = cli(settings, "update-weights", "--reset")
    assert proc.returncode == 0 and current(r, q).path is None
    both = cli(settings, "update-weights", str(a), "--reset")
    assert both.returncode == exitcodes.USAGE


def test_client_draws_no_progress_bar_on_a_terminal_unasked(settings) -> None:
    """With stderr on a terminal, a trainer's `wait` draws nothing (the bar is opt-in:
    `progress=True`), while `progress=True` does draw one there."""
    script = _TRAINER.replace('print("trainer-output")', "client.wait(ids[:1], progress=ARG)")
    seen: dict[bool, str] = {}
    for asked in (False, True):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEACHERQ_")}
        env.update(to_env(settings), PYTHONPATH=str(REPO), COLUMNS="120")
        env.pop("TEACHERQ_LOG__LEVEL", None)
        code, chunks, out = run_with_terminal_stderr(
            [sys.executable, "-c", script.replace("ARG", str(asked))], env=env
        )
        assert code == 0, chunks.decode(errors="replace")
        assert out == b""
        seen[asked] = chunks.decode(errors="replace")
    assert seen[False] == ""
    assert "teacher jobs" in seen[True]


def test_cli_verbs_log_per_job_only_when_asked(settings) -> None:
    """`teacherq submit` prints its job ids and nothing on stderr unless TEACHERQ_LOG__LEVEL
    asks for logs (then one `submit.end` line per job, on stderr)."""
    lines = "".join(json.dumps({"input_ids": [1, 2, n]}) + "\n" for n in range(3, 6))
    quiet = cli(settings, "submit", "-", stdin=lines, env={"TEACHERQ_LOG__LEVEL": None})
    assert quiet.returncode == 0 and len(quiet.stdout.split()) == 3
    assert quiet.stderr == ""
    loud = cli(settings, "submit", "-", stdin=lines, env={"TEACHERQ_LOG__LEVEL": "info"})
    assert loud.returncode == 0 and loud.stdout == quiet.stdout
    assert loud.stderr.count('"submit.end"') == 3
