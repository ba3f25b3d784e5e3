"""The plain Kubernetes manifests (deploy/kubernetes/) are valid Kubernetes objects, every flag and
env var they give a role exists on it, and the autoscaling example scales them on real metrics."""

import re

from tests.kube import ROLES, ROOT, assert_shared_env_exists, assert_valid_kubernetes, load, of_kind, role_configs

MANIFEST = ROOT / "deploy" / "kubernetes" / "pdq.yaml"
AUTOSCALING = ROOT / "deploy" / "kubernetes" / "autoscaling.yaml"


def test_the_manifests_are_valid_kubernetes_objects():
    docs = load(MANIFEST)
    assert_valid_kubernetes(docs)
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"} == {doc["kind"] for doc in docs}


def test_manifest_commands_use_real_flags_and_env():
    docs = load(MANIFEST)
    assert set(role_configs(docs)) == set(ROLES)
    assert_shared_env_exists(docs)


def test_the_scheduler_runs_two_replicas_that_roll_one_at_a_time_and_one_always_stays():
    docs = load(MANIFEST)
    scheduler = of_kind(docs, "Deployment")["pdq-scheduler"]["spec"]
    assert scheduler["replicas"] == 2 and scheduler["strategy"]["type"] == "RollingUpdate"
    assert scheduler["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = of_kind(docs, "PodDisruptionBudget")["pdq-scheduler"]["spec"]
    assert pdb["minAvailable"] == 1 and pdb["selector"]["matchLabels"] == scheduler["selector"]["matchLabels"]


def test_the_autoscaling_example_scales_real_deployments_on_metrics_pdq_exports():
    deployments = set(of_kind(load(MANIFEST), "Deployment"))
    scaled = load(AUTOSCALING)
    assert {doc["spec"]["scaleTargetRef"]["name"] for doc in scaled} == {"pdq-prefill", "pdq-decode"} <= deployments
    assert_scaled_objects_read_real_metrics(scaled)


def assert_scaled_objects_read_real_metrics(scaled: list[dict]) -> None:
    """KEDA ScaledObjects (a CRD, so checked here): every trigger queries metrics pdq exports."""
    from prometheus_client import REGISTRY

    import pdq.observability.metrics  # noqa: F401 (registers every metric)

    names = {m.name + suffix for m in REGISTRY.collect() for suffix in ("", "_total", "_bucket", "_count", "_sum")}
    for doc in scaled:
        assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
        spec = doc["spec"]
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] and spec["triggers"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus" and trigger["metricType"] in ("Value", "AverageValue")
            query = trigger["metadata"]["query"]
            used = set(re.findall(r"\bpdq_[a-z_]+", query))
            assert used and used <= names, (query, used - names)  # every metric it reads exists
            assert trigger["metadata"]["serverAddress"].startswith("http")
            float(trigger["metadata"]["threshold"])
