"""The Kubernetes manifests parse, and every flag they pass exists on the role it runs."""

import argparse
from pathlib import Path

import yaml

from pdq.config import DecodeConfig, GatewayConfig, PrefillConfig, SchedulerConfig, add_arguments

ROOT = Path(__file__).resolve().parent.parent
ROLES = {"gateway": GatewayConfig, "scheduler": SchedulerConfig, "prefill": PrefillConfig, "decode": DecodeConfig}


def test_manifest_commands_use_real_flags_and_env():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "pdq.yaml").read_text()))
    seen = set()
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            _, role, *flags = container["command"]
            parser = argparse.ArgumentParser(exit_on_error=False)
            add_arguments(parser, ROLES[role])
            parser.parse_args(flags)  # raises on an unknown flag
            fields = {f.upper() for f in ROLES[role].__dataclass_fields__}
            for env in container.get("env", []):
                if env["name"].startswith("PDQ_"):
                    assert env["name"][4:] in fields, (role, env["name"])
            seen.add(role)
    assert seen == set(ROLES)


def test_the_autoscaling_example_scales_real_deployments_on_metrics_pdq_exports():
    import re

    from prometheus_client import REGISTRY

    import pdq.metrics  # noqa: F401 (registers every metric)

    names = {m.name + suffix for m in REGISTRY.collect() for suffix in ("", "_total", "_bucket", "_count", "_sum")}
    deployments = {doc["metadata"]["name"] for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "pdq.yaml")
                                                                          .read_text()) if doc["kind"] == "Deployment"}
    scaled = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "autoscaling.yaml").read_text()))
    assert {doc["spec"]["scaleTargetRef"]["name"] for doc in scaled} == {"pdq-prefill", "pdq-decode"} <= deployments
    for doc in scaled:
        assert doc["kind"] == "ScaledObject" and doc["spec"]["minReplicaCount"] >= 1
        for trigger in doc["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            used = set(re.findall(r"\bpdq_[a-z_]+", query))
            assert used and used <= names, (query, used - names)  # every metric it reads exists
            float(trigger["metadata"]["threshold"])
