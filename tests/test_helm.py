"""The Helm chart (deploy/helm/pdq), rendered by Helm's own engine: valid Kubernetes objects, every
role a valid configuration of real flags and env vars, and what its values promise."""

import dataclasses

import pytest

from pdq.state.redis_url import parse_sentinel_url

from tests.kube import (
    CHART,
    POD_IP,
    ROLES,
    ROOT,
    assert_shared_env_exists,
    assert_valid_kubernetes,
    load,
    of_kind,
    render,
    role_configs,
)
from tests.test_deploy import AUTOSCALING, assert_scaled_objects_read_real_metrics

REQUIRED = {"redis": {"url": "redis://my-redis:6379/0"}, "auth": {"keys": "keys: [{key: k1, tenant: acme}]\n"}}
EVERYTHING = {
    **REQUIRED,
    "model": {"name": "/models/llama", "volume": {"persistentVolumeClaim": {"claimName": "llama"}}},
    "sharedEnv": {"PDQ_KEY_PREFIX": "prod", "PDQ_TIERS": "interactive,batch,offline", "PDQ_WORKER_TIMEOUT_S": 20},
    "otlp": {"endpoint": "http://otel-collector.monitoring:4317"},
    "metrics": {"port": 9400, "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus"}}},
    "autoscaling": {"enabled": True},
    "image": {"repository": "registry.example/pdq", "tag": "0.2.0"},
    "imagePullSecrets": [{"name": "registry"}],
    "scheduler": {"replicas": 3, "extraArgs": ["--max-batch-size", "64", "--fair-policy", "fifo"],
                  "resources": {"requests": {"cpu": "1"}}},
    "prefill": {"extraArgs": ["--prefill-chunk", "256"], "nodeSelector": {"pool": "gpu"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "decode": {"kvBudgetTokens": 1048576, "extraEnv": [{"name": "PDQ_STRATEGY", "value": "dynamic"}],
               "livenessProbe": {"periodSeconds": 20}, "podAnnotations": {"team": "inference"}},
    "gateway": {"httpPort": 0, "service": {"type": "LoadBalancer", "annotations": {"lb": "internal"}},
                "pdb": {"enabled": False}},
}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def test_the_chart_renders_valid_kubernetes_objects_with_its_defaults_and_with_every_option_set():
    defaults = render(REQUIRED)
    assert_valid_kubernetes(defaults)
    assert sorted(of_kind(defaults, "Deployment")) == ["pdq-decode", "pdq-gateway", "pdq-prefill", "pdq-scheduler"]
    everything = render(EVERYTHING)
    assert_valid_kubernetes(everything)
    assert {"ScaledObject", "PodMonitor"} <= {doc["kind"] for doc in everything}


def test_every_role_the_chart_runs_is_a_valid_configuration_of_real_flags_and_env():
    for values in (REQUIRED, EVERYTHING):
        docs = render(values)
        assert set(role_configs(docs)) == set(ROLES)
        assert_shared_env_exists(docs)
    configs = role_configs(render(EVERYTHING))
    scheduler, prefill, decode, gateway = (configs[role] for role in ("scheduler", "prefill", "decode", "gateway"))
    assert (scheduler.max_batch_size, scheduler.fair_policy, prefill.prefill_chunk) == (64, "fifo", 256)
    assert (decode.kv_budget_tokens, decode.strategy, decode.kv_port, decode.grace_s) == (1048576, "dynamic", 50072, 45)
    for config in configs.values():
        assert (config.key_prefix, config.tier_names, config.worker_timeout_s) == \
               ("prod", ["interactive", "batch", "offline"], 20)
        assert config.metrics_port == 9400
    for worker in (prefill, decode):
        assert worker.model == "/models/llama" and worker.advertise_address == f"{POD_IP}:{worker.port}"
    assert gateway.model == "/models/llama" and gateway.http_port == 0


def test_the_gateway_reaches_the_scheduler_service_and_reads_the_api_keys_it_mounts():
    for release, prefix in (("pdq", "pdq"), ("prod", "prod-pdq")):
        docs = render(REQUIRED, release=release)
        gateway = role_configs(docs)["gateway"]
        service = of_kind(docs, "Service")[f"{prefix}-scheduler"]
        assert gateway.scheduler_address == f"{prefix}-scheduler:{service['spec']['ports'][0]['port']}"
        spec = pod_spec(of_kind(docs, "Deployment")[f"{prefix}-gateway"])
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if gateway.auth_file.startswith(m["mountPath"]))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])["secret"]
        secret = of_kind(docs, "Secret")[volume["secretName"]]
        key = next(item["key"] for item in volume["items"] if f"{mount['mountPath']}/{item['path']}" == gateway.auth_file)
        assert secret["stringData"][key] == REQUIRED["auth"]["keys"]


def test_every_service_and_disruption_budget_selects_the_pods_of_its_role_by_their_port_names():
    docs = render(REQUIRED)
    deployments = of_kind(docs, "Deployment")
    pdbs = of_kind(docs, "PodDisruptionBudget")
    assert set(pdbs) == set(deployments)
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pdbs[name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for name, service in of_kind(docs, "Service").items():
        pods = [d for d in deployments.values()
                if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert [d["metadata"]["name"] for d in pods] == [name]
        ports = {p["name"] for p in pod_spec(pods[0])["containers"][0]["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_the_scheduler_defaults_to_two_replicas_that_roll_one_at_a_time_and_one_always_stays():
    docs = render(REQUIRED)
    scheduler = of_kind(docs, "Deployment")["pdq-scheduler"]["spec"]
    assert scheduler["replicas"] == 2 and scheduler["strategy"]["type"] == "RollingUpdate"
    assert scheduler["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert of_kind(docs, "PodDisruptionBudget")["pdq-scheduler"]["spec"]["minAvailable"] == 1
    replicas = {name: d["spec"].get("replicas") for name, d in of_kind(render(EVERYTHING), "Deployment").items()}
    assert replicas == {"pdq-scheduler": 3, "pdq-gateway": 2, "pdq-prefill": None, "pdq-decode": None}  # KEDA's


def test_every_pod_is_probed_on_its_grpc_port_and_scraped_on_the_port_it_serves_metrics_on():
    docs = render(EVERYTHING)
    port = role_configs(docs)["gateway"].metrics_port
    monitors = of_kind(docs, "PodMonitor")
    for name, deployment in of_kind(docs, "Deployment").items():
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        assert {"name": "metrics", "containerPort": port} in container["ports"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        grpc = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert container["readinessProbe"]["grpc"] == {"port": grpc}
        monitor = monitors[name]["spec"]
        assert monitor["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert monitor["podMetricsEndpoints"][0]["port"] == "metrics"
        assert monitors[name]["metadata"]["labels"]["release"] == "kube-prometheus"
    assert of_kind(docs, "Deployment")["pdq-decode"]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"] == \
           {"grpc": {"port": 50071}, "periodSeconds": 20}
    assert of_kind(docs, "ConfigMap")["pdq-config"]["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == \
           "http://otel-collector.monitoring:4317"
    assert not of_kind(render(REQUIRED), "PodMonitor")


def test_redis_sentinel_and_the_api_keys_come_from_the_charts_secrets_or_from_secrets_of_your_own():
    def redis_ref(docs):
        env = pod_spec(of_kind(docs, "Deployment")["pdq-decode"])["containers"][0]["env"]
        return next(e["valueFrom"]["secretKeyRef"] for e in env if e["name"] == "PDQ_REDIS_URL")

    docs = render(REQUIRED)
    ref = redis_ref(docs)
    assert of_kind(docs, "Secret")[ref["name"]]["stringData"][ref["key"]] == "redis://my-redis:6379/0"

    own = render({"redis": {"existingSecret": "my-redis", "existingSecretKey": "uri"},
                  "auth": {"existingSecret": "my-keys", "existingSecretKey": "api-keys.yaml"}})
    assert not of_kind(own, "Secret") and redis_ref(own) == {"name": "my-redis", "key": "uri"}
    volume = pod_spec(of_kind(own, "Deployment")["pdq-gateway"])["volumes"][0]["secret"]
    assert volume == {"secretName": "my-keys", "items": [{"key": "api-keys.yaml", "path": "keys.yaml"}]}

    sentinel = render({**REQUIRED, "redis": {"sentinel": {"hosts": ["sentinel-0:26379", "sentinel-1:26380"],
                                                          "service": "pdq", "db": 2, "password": "p@ss/w:rd"}}})
    ref = redis_ref(sentinel)
    assert of_kind(sentinel, "Secret")[ref["name"]]["stringData"][ref["key"]] == \
           "redis+sentinel://:p%40ss%2Fw%3Ard@sentinel-0:26379,sentinel-1:26380/pdq/2"
    guarded = render({**REQUIRED, "redis": {"sentinel": {"hosts": ["s-0"], "service": "pdq", "sentinelPassword": "s&p"}}})
    url = of_kind(guarded, "Secret")[redis_ref(guarded)["name"]]["stringData"][redis_ref(guarded)["key"]]
    assert url == "redis+sentinel://s-0/pdq/0?sentinel_password=s%26p"
    assert parse_sentinel_url(url).sentinel_auth == {"password": "s&p"}
    tls_url = "rediss+sentinel://s-0,s-1/pdq/0?ssl_ca_certs=/etc/ssl/certs/ca-certificates.crt"
    tls = render({**REQUIRED, "redis": {"url": tls_url}})  # the schema takes a TLS Sentinel URL
    assert of_kind(tls, "Secret")[redis_ref(tls)["name"]]["stringData"][redis_ref(tls)["key"]] == tls_url

    open_gateway = render({"redis": REQUIRED["redis"], "auth": {"enabled": False}})
    assert role_configs(open_gateway)["gateway"].auth_file == ""
    assert "volumes" not in pod_spec(of_kind(open_gateway, "Deployment")["pdq-gateway"])


@pytest.mark.parametrize("values, message", [
    ({"auth": REQUIRED["auth"]}, "pdq needs Redis: set redis.url"),
    ({"redis": REQUIRED["redis"]}, "the gateway's API keys: set auth.keys"),
    ({**REQUIRED, "redis": {"url": "redis://a:6379/0", "existingSecret": "b"}}, "not several"),
])
def test_the_chart_refuses_to_render_without_redis_or_api_keys_saying_what_to_set(values, message):
    import helm_python

    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


def test_a_misspelt_or_mistyped_value_is_refused_naming_it():
    import helm_python

    for values, message in (({"scheduler": {"replica": 3}}, "'replica' not allowed"),
                            ({"decode": {"kvBudgetTokens": "lots"}}, "/decode/kvBudgetTokens"),
                            ({"redis": {"url": "http://my-redis:6379"}}, "/redis/url")):
        with pytest.raises(helm_python.HelmValuesError, match=message):
            render({**REQUIRED, **values})


def test_the_charts_autoscaler_is_off_by_default_and_on_is_the_plain_example():
    assert not of_kind(render(REQUIRED), "ScaledObject")
    chart = of_kind(render(EVERYTHING), "ScaledObject")
    plain = {doc["metadata"]["name"]: doc for doc in load(AUTOSCALING)}
    assert {name: doc["spec"] for name, doc in chart.items()} == {name: doc["spec"] for name, doc in plain.items()}
    deployments = of_kind(render(EVERYTHING), "Deployment")
    assert {doc["spec"]["scaleTargetRef"]["name"] for doc in chart.values()} <= set(deployments)
    assert_scaled_objects_read_real_metrics(list(chart.values()))


def test_helm_lints_the_chart_without_errors():
    import helm_python

    result = helm_python.lint(CHART, REQUIRED, strict=True, namespace="pdq")
    assert result["errors"] == [] and all(m["severity"] <= 1 for m in result["messages"]), result  # 1: INFO


def test_the_chart_and_the_plain_manifests_run_each_role_with_the_same_defaults():
    chart = role_configs(render(REQUIRED))
    plain = role_configs(load(ROOT / "deploy" / "kubernetes" / "pdq.yaml"))
    for role in ROLES:  # the plain manifests' Redis URL is a Secret you make
        assert dataclasses.replace(chart[role], redis_url=plain[role].redis_url) == plain[role], role
