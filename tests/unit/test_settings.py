"""Settings: fixed env names, nesting, file source, validation messages."""

from __future__ import annotations

import json

import pytest

from shared.settings import Settings, SettingsError, load_settings, to_env


def test_defaults_need_no_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(__import__("os").environ):
        if k.startswith("TEACHERQ_"):
            monkeypatch.delenv(k)
    s = load_settings()
    assert s.redis.url is None  # embedded server
    assert s.queue.name == "default"
    assert s.model.path is None  # tiny preset
    assert s.parallel.tp == 1 and s.parallel.pp == 1
    assert s.storage.url.startswith("file://")


def test_fixed_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEACHERQ_REDIS__URL", "redis://:secret@example:6380/2")
    monkeypatch.setenv("TEACHERQ_QUEUE__NAME", "distill")
    monkeypatch.setenv("TEACHERQ_MODEL__PATH", "/ckpt/qwen")
    monkeypatch.setenv("TEACHERQ_STORAGE__URL", "s3://bucket/prefix")
    monkeypatch.setenv("TEACHERQ_PARALLEL__TP", "4")
    monkeypatch.setenv("TEACHERQ_PARALLEL__PP", "1")
    s = load_settings()
    assert s.redis.url == "redis://:secret@example:6380/2"
    assert s.queue.name == "distill"
    assert s.model.path == "/ckpt/qwen"
    assert s.storage.url == "s3://bucket/prefix"
    assert s.parallel.tp == 4


def test_errors_name_the_field_and_allowed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEACHERQ_MODEL__DTYPE", "fp8")
    monkeypatch.setenv("TEACHERQ_PARALLEL__TP", "0")
    with pytest.raises(SettingsError) as info:
        load_settings()
    msg = str(info.value)
    assert "TEACHERQ_MODEL__DTYPE" in msg and "'bfloat16'" in msg and "fp8" in msg
    assert "TEACHERQ_PARALLEL__TP" in msg and "greater than or equal to 1" in msg


@pytest.mark.parametrize(
    ("env", "value", "fragment"),
    [
        ("TEACHERQ_REDIS__URL", "http://x", "redis://"),
        ("TEACHERQ_QUEUE__NAME", "a{b}", "braces"),
        ("TEACHERQ_PARALLEL__MICROBATCHES", "-1", "greater than or equal to 0"),
        ("TEACHERQ_CONSUMER__TRAIN", "true", "teacher-only"),
        ("TEACHERQ_QUEUE__NOPE", "1", "Extra inputs are not permitted"),
    ],
)
def test_each_invalid_value_is_refused(monkeypatch, env, value, fragment) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError, match=fragment):
        load_settings()


def test_settings_file_below_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    cfg = tmp_path / "teacherq.yaml"
    cfg.write_text("queue:\n  name: fromfile\nparallel:\n  tp: 2\n")
    monkeypatch.setenv("TEACHERQ_CONFIG", str(cfg))
    monkeypatch.setenv("TEACHERQ_PARALLEL__TP", "8")
    s = load_settings()
    assert s.queue.name == "fromfile"
    assert s.parallel.tp == 8  # the environment wins


def test_missing_settings_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TEACHERQ_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(SettingsError, match="nope.yaml"):
        load_settings()


def test_example_configs_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert configs, "configs/ should hold example settings files"
    for path in configs:
        monkeypatch.setenv("TEACHERQ_CONFIG", str(path))
        load_settings()


def test_to_env_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(queue={"name": "rt"}, parallel={"tp": 2}, redis={"url": "redis://h:1/0"})
    for k, v in to_env(s).items():
        monkeypatch.setenv(k, v)
    assert load_settings() == s
    assert json.loads(json.dumps(s.model_dump(mode="json")))  # serialisable


def test_sections_are_frozen() -> None:
    s = Settings()
    with pytest.raises(Exception, match="frozen"):
        s.queue.name = "x"  # type: ignore[misc]


def test_configuration_doc_lists_every_setting() -> None:
    from pathlib import Path

    from shared.settings import settings_reference

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    assert settings_reference() in doc, "regenerate the table in docs/configuration.md"
