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
