"""Checks shared by the tests of pdq's Kubernetes manifests (deploy/kubernetes/) and its Helm chart
(deploy/helm/pdq): objects valid against the Kubernetes schemas, pdq's containers running real
flags and env vars of their role, and rendering the chart with Helm's own engine (helm-python-sdk,
Helm's Go SDK in a wheel: no helm binary, no cluster)."""

import argparse
import os
import re
from pathlib import Path
from unittest import mock

import kubernetes_validate
import yaml

from pdq.config import DecodeConfig, GatewayConfig, PrefillConfig, SchedulerConfig, add_arguments, from_arguments

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "pdq"
ROLES = {"gateway": GatewayConfig, "scheduler": SchedulerConfig, "prefill": PrefillConfig, "decode": DecodeConfig}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: gRPC probes) and the newest
# whose schemas kubernetes-validate bundles.
KUBE_VERSIONS = ("1.27", kubernetes_validate.latest_version())
CRD_GROUPS = ("keda.sh/", "monitoring.coreos.com/")  # not in the Kubernetes schemas: checked by the tests
POD_IP = "10.1.2.3"


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(values: dict | None = None, release: str = "pdq") -> list[dict]:
    """The chart's objects, as `helm template RELEASE deploy/helm/pdq -f values` renders them."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=release, namespace="pdq")
    return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def assert_valid_kubernetes(docs: list[dict]) -> None:
    """Every object that is no CRD validates, unknown fields included, against each of KUBE_VERSIONS."""
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def role_configs(docs: list[dict]) -> dict[str, object]:
    """Each pdq container's configuration as its process builds it from its command and env (the
    ConfigMaps it reads, its own env, values of the Secrets among `docs`; the downward API left out
    but POD_IP): an unknown flag, a PDQ_* variable its role lacks or an invalid value fails. -> {role: config}"""
    configmaps = {name: doc.get("data", {}) for name, doc in of_kind(docs, "ConfigMap").items()}
    secrets = {name: doc.get("stringData", {}) for name, doc in of_kind(docs, "Secret").items()}
    configs = {}
    for deployment in of_kind(docs, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            pdq, role, *flags = container["command"]
            assert pdq == "pdq" and role in ROLES, container["command"]
            cls = ROLES[role]
            fields = {f.upper() for f in cls.__dataclass_fields__}
            shared = {}
            for source in container.get("envFrom", []):
                shared.update(configmaps[source["configMapRef"]["name"]])
            own = {env["name"]: env.get("value", _secret_value(env, secrets)) for env in container.get("env", [])}
            for name in own:
                if name.startswith("PDQ_"):
                    assert name[4:] in fields, f"{role} has no {name}"
            env = {name: value for name, value in {**shared, **own}.items() if value is not None}
            env["POD_IP"] = POD_IP
            env = {name: re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value) for name, value in env.items()}
            parser = argparse.ArgumentParser(allow_abbrev=False)  # a manifest spells each flag in full
            add_arguments(parser, cls)
            args, unknown = parser.parse_known_args(flags)
            assert not unknown, f"{role} has no {unknown}"
            configs[role] = _from_env(cls, args, {k: v for k, v in env.items() if k.startswith("PDQ_")})
    return configs


def assert_shared_env_exists(docs: list[dict]) -> None:
    """Every PDQ_* key of a ConfigMap is a field of some role whose pods read it."""
    readers: dict[str, set[str]] = {}
    for deployment in of_kind(docs, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for source in container.get("envFrom", []):
                readers.setdefault(source["configMapRef"]["name"], set()).add(container["command"][1])
    for name, doc in of_kind(docs, "ConfigMap").items():
        fields = {f.upper() for role in readers.get(name, ()) for f in ROLES[role].__dataclass_fields__}
        for key in doc.get("data", {}):
            if key.startswith("PDQ_"):
                assert key[4:] in fields, f"ConfigMap {name}: no role that reads it has {key}"


def _secret_value(env: dict, secrets: dict[str, dict]) -> str | None:
    ref = env.get("valueFrom", {}).get("secretKeyRef")
    return secrets.get(ref["name"], {}).get(ref["key"]) if ref else None


def _from_env(cls: type, args: argparse.Namespace, env: dict[str, str]) -> object:
    # from_arguments reads PDQ_* from os.environ: give it the pod's, not this process's
    with mock.patch.dict(os.environ, env, clear=True):
        return from_arguments(cls, args)
