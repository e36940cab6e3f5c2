"""deploy/kubernetes, proven without a cluster: every object the kustomizations list is valid
against the Kubernetes schemas (kubernetes-validate ships them, so no network), and the
manifests agree with the code: TEACHERQ_* names are settings, the KEDA ScaledObject watches the
queue's real jobs stream and group and scales the consumer StatefulSet to zero and back,
consumers request a GPU, are probed on /healthz at their metrics port, and get a grace period
longer than a batch."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shared import keys
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects a kustomization and the ones it includes list (resources only: the
    manifests here use no patches or generators), each with the namespace it sets."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out: list[dict[str, Any]] = []
    for res in spec.get("resources", []):
        path = directory / res
        if path.is_dir():
            out += kustomize(path)
        else:
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    if spec.get("namespace"):
        for obj in out:
            if obj["kind"] != "Namespace":
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return out


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return kustomize(ROOT)


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def test_every_file_is_listed_by_a_kustomization() -> None:
    """No manifest lies beside the kustomizations unused (it would never be applied)."""
    listed = set()
    for k in ROOT.rglob("kustomization.yaml"):
        for res in yaml.safe_load(k.read_text()).get("resources", []):
            listed.add((k.parent / res).resolve())
    files = {p.resolve() for p in ROOT.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files and files <= listed, files - listed


def test_core_objects_are_valid_against_the_kubernetes_schemas(objects) -> None:
    """Strict validation (unknown fields are errors) of every non-CRD object."""
    core = [o for o in objects if "keda.sh" not in o["apiVersion"]]
    assert {o["kind"] for o in core} >= {"StatefulSet", "Deployment", "Service", "ConfigMap"}
    for obj in core:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_schema_violation_is_caught() -> None:
    """The validator is real: a misspelt field fails."""
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "dta": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _env_names(objects) -> set[str]:
    names = set()
    for o in objects:
        if o["kind"] == "ConfigMap":
            names |= set(o.get("data", {}))
        text = yaml.safe_dump(o)
        names |= set(re.findall(r"\bTEACHERQ_[A-Z0-9_]+", text))
    return {n for n in names if n.startswith("TEACHERQ_")}


def test_every_teacherq_variable_is_a_setting(objects) -> None:
    """A renamed setting would be ignored silently by pydantic-settings in a pod: every
    TEACHERQ_* name in the manifests must exist in shared/settings.py."""
    known = {
        f"TEACHERQ_{section}__{name}".upper()
        for section, info in Settings.model_fields.items()
        for name in info.annotation.model_fields  # type: ignore[union-attr]
    }
    used = _env_names(objects)
    assert "TEACHERQ_REDIS__URL" in used
    assert used <= known, used - known


def config(objects) -> Settings:
    """The settings the ConfigMap gives a pod."""
    data = one(objects, "ConfigMap", "teacherq")["data"]
    values: dict[str, dict[str, str]] = {}
    for env, value in data.items():
        section, name = env.removeprefix("TEACHERQ_").lower().split("__", 1)
        values.setdefault(section, {})[name] = value
    return Settings(**values)


def test_consumers_request_a_gpu_are_probed_and_outlast_a_batch(objects) -> None:
    s = config(objects)
    sts = one(objects, "StatefulSet", "teacherq-consumer")
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == s.consumer.metrics_port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    assert pod["terminationGracePeriodSeconds"] > s.consumer.job_timeout_s + s.consumer.stop_grace_s
    assert {"configMapRef": {"name": "teacherq"}} in c["envFrom"]


def test_keda_scales_the_consumers_on_the_groups_lag_to_zero_and_back(objects) -> None:
    s = config(objects)
    so = one(objects, "ScaledObject", "teacherq-consumer")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    target = so["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", "teacherq-consumer")
    assert so["spec"]["minReplicaCount"] == 0 < so["spec"]["maxReplicaCount"]
    triggers = so["spec"]["triggers"]
    lag = [t for t in triggers if "lagCount" in t["metadata"]]
    assert lag, "only a lag trigger can wake the consumers from zero"
    host = re.match(r"redis://([^/]+)/", s.redis.url or "")
    for t in triggers:
        assert t["type"] == "redis-streams"
        m = t["metadata"]
        assert m["stream"] == keys.jobs_stream(s.queue.name)
        assert m["consumerGroup"] == s.queue.group
        assert host and m["address"] == host.group(1)
    assert so["spec"]["cooldownPeriod"] > s.consumer.job_timeout_s


def test_images_are_pinned(objects) -> None:
    for o in objects:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            tag = c["image"].rsplit(":", 1)
            assert len(tag) == 2 and tag[1] not in ("", "latest"), c["image"]


def test_consumers_keep_compiled_kernels_on_a_volume_at_the_cache_dir(objects) -> None:
    """The ConfigMap's consumer.compile_cache_dir is a volume mounted in the consumer
    container (an emptyDir by default; a ReadWriteMany PVC shares it between pods), writable by
    the image's user (fsGroup)."""
    s = config(objects)
    pod = one(objects, "StatefulSet", "teacherq-consumer")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert s.consumer.compile_cache_dir is not None
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    mount = mounts[str(s.consumer.compile_cache_dir)]
    assert not mount.get("readOnly")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mount["name"]] or "persistentVolumeClaim" in volumes[mount["name"]]
    assert pod["securityContext"]["fsGroup"] == 10001
