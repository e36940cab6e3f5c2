"""How `redis.mode` reads the URL (shared/redis_client.connection_plan), without a server."""

from __future__ import annotations

import pytest

from shared.redis_client import connection_plan
from shared.settings import RedisSettings, Settings, SettingsError, load_settings


def test_sentinel_url_names_every_sentinel_and_the_primarys_password_and_db() -> None:
    cfg = RedisSettings(
        url="redis://:p%40ss@s1:26379,s2,10.0.0.3:26380/2",
        mode="sentinel",
        sentinel_master="teach",
    )
    plan = connection_plan(cfg)
    assert plan.sentinels == (("s1", 26379), ("s2", 26379), ("10.0.0.3", 26380))
    assert plan.service == "teach"
    assert plan.master_options == {"db": 2, "password": "p@ss"}


def test_cluster_and_standalone_keep_the_url() -> None:
    for mode in ("cluster", "standalone"):
        plan = connection_plan(RedisSettings(url="redis://node-1:7000/0", mode=mode))
        assert (plan.mode, plan.url, plan.sentinels) == (mode, "redis://node-1:7000/0", ())
    assert connection_plan(RedisSettings(url="redis://n:1/0", mode="cluster")).retries > 5


def test_cluster_or_sentinel_without_a_url_is_a_settings_error(monkeypatch) -> None:
    monkeypatch.setenv("TEACHERQ_REDIS__MODE", "cluster")
    monkeypatch.delenv("TEACHERQ_REDIS__URL", raising=False)
    with pytest.raises(SettingsError, match="redis.mode=cluster needs TEACHERQ_REDIS__URL"):
        load_settings()
    with pytest.raises(ValueError, match="'standalone', 'cluster' or 'sentinel'"):
        Settings(redis={"url": "redis://x:1/0", "mode": "replicated"})


def test_rq_worker_refuses_a_cluster_with_the_setting_named() -> None:
    """rq cannot run on a Redis Cluster: `teacherq worker` says so before connecting."""
    from producer.datasets.rq_plumbing import run_worker

    s = Settings(redis={"url": "redis://127.0.0.1:1/0", "mode": "cluster"})
    with pytest.raises(SettingsError, match="TEACHERQ_REDIS__MODE=cluster"):
        run_worker(s, burst=True)
