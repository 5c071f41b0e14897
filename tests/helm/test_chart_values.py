"""The Helm chart in helm/tandem, rendered offline: how values turn into flags, volumes,
Secrets, autoscaling, monitoring and security settings, and which values are refused.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helm.rendering import (
    CHART_DIR,
    ENGINE,
    FRONTEND,
    HEADLESS,
    HOSTPATH_VALUES,
    MONITORING_VALUES,
    NAMESPACE,
    RELEASE,
    SCALE_VALUES,
    TLS_VALUES,
    VALUE_SETS,
    container,
    container_port,
    find,
    flag,
    helm,
    kinds,
    notes,
    render,
    render_error,
    selects,
)

# --------------------------------------------------------------------------- scale


def test_three_engines_and_autoscaled_frontend(chart):
    objects = render(chart, SCALE_VALUES)
    assert find(objects, "Deployment", ENGINE)["spec"]["replicas"] == 3
    frontend = find(objects, "Deployment", FRONTEND)
    assert "replicas" not in frontend["spec"]  # the HPA owns it
    hpa = find(objects, "HorizontalPodAutoscaler", FRONTEND)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FRONTEND}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    assert container(frontend)["resources"]["requests"]["cpu"]


def test_pod_disruption_budgets_select_their_pods(chart):
    objects = render(chart, SCALE_VALUES)
    for name in (ENGINE, FRONTEND):
        pdb = find(objects, "PodDisruptionBudget", name)
        labels = find(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
        assert pdb["spec"]["maxUnavailable"] == 1
    pdb = find(render(chart, {"engine": {"pdb": {"minAvailable": "50%"}}}), "PodDisruptionBudget", ENGINE)
    assert pdb["spec"] == {"minAvailable": "50%", "selector": pdb["spec"]["selector"]}


def test_engine_selector_does_not_match_frontends(chart):
    objects = render(chart)
    engine = find(objects, "Deployment", ENGINE)
    frontend = find(objects, "Deployment", FRONTEND)
    assert not selects(engine["spec"]["selector"]["matchLabels"], frontend["spec"]["template"]["metadata"]["labels"])
    assert not selects(frontend["spec"]["selector"]["matchLabels"], engine["spec"]["template"]["metadata"]["labels"])


# --------------------------------------------------------------------------- model source


def test_default_is_demo_model_on_writable_cache(chart):
    objects = render(chart)
    c = container(find(objects, "Deployment", ENGINE))
    assert "--model" not in c["args"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert env["TANDEM_CACHE_DIR"].startswith(mounts["cache"])
    volumes = {v["name"]: v for v in find(objects, "Deployment", ENGINE)["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["cache"] and "model" not in volumes
    assert "demo model" in notes(chart)


def test_pvc_model(chart):
    objects = render(chart, {"engine": {"model": {"pvc": {"claimName": "models"}, "path": "Qwen2.5-0.5B"}}})
    engine = find(objects, "Deployment", ENGINE)
    c = container(engine)
    assert flag(c["args"], "--model") == ["/models/Qwen2.5-0.5B"]
    volumes = {v["name"]: v for v in engine["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_hostpath_model(chart):
    engine = find(render(chart, HOSTPATH_VALUES), "Deployment", ENGINE)
    assert flag(container(engine)["args"], "--model") == ["/models/llama"]
    volumes = {v["name"]: v for v in engine["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}


def test_model_source_without_location_is_rejected(chart):
    assert "engine.model.hostPath.path" in render_error(chart, {"engine": {"model": {"source": "hostPath"}}})
    assert "engine.model.image.reference" in render_error(chart, {"engine": {"model": {"source": "image"}}})


# --------------------------------------------------------------------------- flags


def test_engine_flags_from_values(chart):
    values = {
        "engine": {
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 4096,
            "maxWaiting": 500,
            "kvCache": {"blockSize": 32, "numBlocks": 2048, "prefixCaching": False, "populate": False},
            "extraArgs": ["--seed", "7"],
        },
        "logging": {"level": "DEBUG", "format": "text"},
    }
    args = container(find(render(chart, values), "Deployment", ENGINE))["args"]
    assert flag(args, "--max-num-seqs") == ["64"]
    assert flag(args, "--max-num-batched-tokens") == ["4096"]
    assert flag(args, "--max-waiting") == ["500"]
    assert flag(args, "--block-size") == ["32"]
    assert flag(args, "--num-kv-blocks") == ["2048"]
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert "--no-kv-cache-populate" in args and "--kv-cache-populate" not in args
    assert flag(args, "--log-level") == ["DEBUG"] and flag(args, "--log-format") == ["text"]
    assert args[-2:] == ["--seed", "7"]
    assert "--kv-cache-bytes" not in args and "--dtype" not in args


def test_frontend_workers_from_values(chart):
    args = container(find(render(chart), "Deployment", FRONTEND))["args"]
    assert "--workers" not in args  # one process, the frontend's default
    args = container(find(render(chart, {"frontend": {"workers": 3}}), "Deployment", FRONTEND))["args"]
    assert flag(args, "--workers") == ["3"]
    assert "/frontend/workers" in render_error(chart, {"frontend": {"workers": 0}})


def test_frontend_routing_flags_from_values(chart):
    args = container(find(render(chart), "Deployment", FRONTEND))["args"]
    assert flag(args, "--routing") == ["prefix"] and "--routing-load-threshold" not in args
    values = {"frontend": {"routing": {"policy": "least-load", "loadThresholdTokens": 16384}}}
    args = container(find(render(chart, values), "Deployment", FRONTEND))["args"]
    assert flag(args, "--routing") == ["least-load"] and flag(args, "--routing-load-threshold") == ["16384"]
    args = container(find(render(chart, {"frontend": {"routing": {"policy": ""}}}), "Deployment", FRONTEND))["args"]
    assert "--routing" not in args
    assert "/frontend/routing/policy" in render_error(chart, {"frontend": {"routing": {"policy": "random"}}})


def test_unset_engine_sizes_keep_engine_defaults(chart):
    args = container(find(render(chart), "Deployment", ENGINE))["args"]
    for name in ("--max-num-seqs", "--max-num-batched-tokens", "--max-waiting", "--block-size", "--num-kv-blocks"):
        assert name not in args
    assert "--kv-cache-populate" in args  # a deployment reserves its KV memory at start


def test_both_kv_cache_sizes_rejected(chart):
    assert "not both" in render_error(chart, {"engine": {"kvCache": {"numBlocks": 10, "bytes": 10}}})


def test_metrics_flags(chart):
    objects = render(chart)
    assert flag(container(find(objects, "Deployment", ENGINE))["args"], "--metrics-port") == ["9090"]
    assert flag(container(find(objects, "Deployment", FRONTEND))["args"], "--metrics-port") == ["9091"]
    objects = render(chart, {"metrics": {"enabled": False}})
    assert flag(container(find(objects, "Deployment", ENGINE))["args"], "--metrics-port") == ["0"]
    assert flag(container(find(objects, "Deployment", FRONTEND))["args"], "--metrics-port") == ["0"]
    assert ("Service", f"{FRONTEND}-metrics") not in kinds(objects)


def test_tls_flags_and_secrets(chart):
    objects = render(chart, TLS_VALUES)
    engine = find(objects, "Deployment", ENGINE)
    frontend = find(objects, "Deployment", FRONTEND)
    e_args, f_args = container(engine)["args"], container(frontend)["args"]
    assert flag(e_args, "--tls-cert") == ["/etc/tandem/tls/tls.crt"]
    assert flag(e_args, "--tls-key") == ["/etc/tandem/tls/tls.key"]
    assert flag(e_args, "--tls-ca") == ["/etc/tandem/tls/ca.crt"]  # client certs required
    assert flag(f_args, "--tls-cert") == ["/etc/tandem/tls/tls.crt"]
    assert flag(f_args, "--tls-key") == ["/etc/tandem/tls/tls.key"]
    assert flag(f_args, "--engine-tls-ca") == ["/etc/tandem/engine-tls/ca.crt"]
    assert flag(f_args, "--engine-tls-cert") == ["/etc/tandem/engine-tls/tls.crt"]
    assert flag(f_args, "--engine-tls-key") == ["/etc/tandem/engine-tls/tls.key"]
    assert flag(f_args, "--api-key-file") == ["/etc/tandem/auth/api-keys"]

    def secrets(deployment):
        return {
            v["name"]: v["secret"]["secretName"]
            for v in deployment["spec"]["template"]["spec"]["volumes"]
            if "secret" in v
        }

    assert secrets(engine) == {"tls": "tandem-engine-tls"}
    assert secrets(frontend) == {
        "tls": "tandem-frontend-tls",
        "engine-tls": "tandem-frontend-client-tls",
        "auth": "tandem-api-keys",
    }
    assert "-cacert" in notes(chart, TLS_VALUES) and "authorization: Bearer" in notes(chart, TLS_VALUES)


def test_no_tls_flags_by_default(chart):
    objects = render(chart)
    for name in (ENGINE, FRONTEND):
        assert not [a for a in container(find(objects, "Deployment", name))["args"] if "tls" in a]


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"tls": {"engine": {"enabled": True}}}, "tls.engine.existingSecret"),
        ({"tls": {"frontend": {"enabled": True}}}, "tls.frontend.existingSecret"),
        ({"engine": {"containerPorts": {"metrics": 50051}}}, "engine.containerPorts"),
        ({"frontend": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}, "frontend.autoscaling"),
        (
            {"frontend": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}},
            "frontend.resources.requests.cpu",
        ),
        ({"engine": {"pdb": {"minAvailable": "", "maxUnavailable": ""}}}, "engine.pdb"),
        (
            {"frontend": {"preStopSleepSeconds": 30, "terminationGracePeriodSeconds": 20}},
            "frontend.terminationGracePeriodSeconds",
        ),
    ],
)
def test_values_validation_rejects(chart, values, where):
    message = render_error(chart, values)
    assert "VALUES VALIDATION" in message and f"tandem: {where}" in message, message


def test_otlp_endpoint(chart):
    objects = render(chart, MONITORING_VALUES)
    for name, service in ((ENGINE, "tandem-engine"), (FRONTEND, "tandem-frontend")):
        c = container(find(objects, "Deployment", name))
        assert flag(c["args"], "--otlp-endpoint") == ["http://otel-collector.observability:4317"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["OTEL_SERVICE_NAME"] == service
    assert "--otlp-endpoint" not in container(find(render(chart), "Deployment", ENGINE))["args"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_args_parse_with_the_service_clis(chart, name):
    """The flags the chart writes are the ones tandem-engine and tandem-frontend accept."""
    from engine_svc.config import EngineConfig
    from engine_svc.config import build_parser as engine_parser
    from frontend_svc.config import FrontendConfig
    from frontend_svc.config import build_parser as frontend_parser

    objects = render(chart, VALUE_SETS[name])
    engine_c = container(find(objects, "Deployment", ENGINE))
    frontend_c = container(find(objects, "Deployment", FRONTEND))
    assert engine_c["command"] == ["tandem-engine"] and frontend_c["command"] == ["tandem-frontend"]

    engine = EngineConfig.from_args(engine_parser().parse_args(engine_c["args"]))
    assert engine.port == container_port(engine_c, "grpc")
    assert engine.metrics_port == container_port(engine_c, "metrics")
    assert engine.host == "0.0.0.0"
    assert engine.device == VALUE_SETS[name].get("engine", {}).get("device", "cpu")

    frontend = FrontendConfig.from_args(frontend_parser().parse_args(frontend_c["args"]))
    assert frontend.check() == []
    assert frontend.port == container_port(frontend_c, "grpc")
    assert frontend.engines == [f"dns:///{HEADLESS}.{NAMESPACE}.svc.cluster.local:{engine.port}"]
    assert bool(engine.tls_ca) == bool(frontend.engine_tls_cert) == (name == "tls")


# --------------------------------------------------------------------------- monitoring


def test_service_monitors(chart):
    objects = render(chart, MONITORING_VALUES)
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert sorted(m["metadata"]["name"] for m in monitors) == [ENGINE, FRONTEND]
    services = [o for o in objects if o["kind"] == "Service"]
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
        # Exactly one selected Service has a port named metrics, and it reaches the right pods.
        selected = [s for s in services if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        with_metrics = [s for s in selected if any(p["name"] == "metrics" for p in s["spec"]["ports"])]
        assert len(with_metrics) == 1, monitor["metadata"]["name"]
        deployment = find(objects, "Deployment", monitor["metadata"]["name"])
        assert selects(with_metrics[0]["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert not [o for o in render(chart) if o["kind"] == "ServiceMonitor"]


# --------------------------------------------------------------------------- security


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_pods_run_non_root_with_read_only_root(chart, name):
    objects = render(chart, VALUE_SETS[name])
    for deployment_name in (ENGINE, FRONTEND):
        pod = find(objects, "Deployment", deployment_name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == f"{RELEASE}-tandem"
        c = pod["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HOME"] in mounts


# --------------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"engine": {"replicaCount": -1}}, "/engine/replicaCount"),
        ({"frontend": {"replicaCount": -2}}, "/frontend/replicaCount"),
        ({"engine": {"replicaCount": 1.5}}, "/engine/replicaCount"),
        ({"engine": {"device": "tpu"}}, "/engine/device"),
        ({"engine": {"dtype": "int8"}}, "/engine/dtype"),
        ({"engine": {"containerPorts": {"grpc": 0}}}, "/engine/containerPorts/grpc"),
        ({"frontend": {"containerPorts": {"grpc": 70000}}}, "/frontend/containerPorts/grpc"),
        ({"engine": {"gpu": {"count": 0}}}, "/engine/gpu/count"),
        ({"engine": {"model": {"source": "s3"}}}, "/engine/model/source"),
        ({"logging": {"format": "xml"}}, "/logging/format"),
        ({"frontend": {"service": {"type": "ExternalName"}}}, "/frontend/service/type"),
        ({"engine": {"livenessProbe": {"successThreshold": 2}}}, "/engine/livenessProbe/successThreshold"),
        ({"engine": {"replicas": 3}}, "replicas"),  # typo of replicaCount
    ],
)
def test_schema_rejects_bad_values(chart, values, where):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(info.value)
    assert "values don't meet the specifications of the schema" in message
    assert where in message, message


def test_schema_accepts_zero_replicas(chart):
    objects = render(chart, {"engine": {"replicaCount": 0}, "frontend": {"replicaCount": 0}})
    assert find(objects, "Deployment", ENGINE)["spec"]["replicas"] == 0


def test_values_are_all_documented():
    """Every leaf key of values.yaml has an `## @param` line, and every @param names a key."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    params = {
        line.split()[2]
        for line in (CHART_DIR / "values.yaml").read_text().splitlines()
        if line.strip().startswith("## @param ")
    }

    def documented(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in params for i in range(1, len(parts) + 1))

    def leaves(node, prefix=""):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                yield from leaves(value, f"{prefix}.{key}" if prefix else key)
        else:
            yield prefix

    undocumented = [path for path in leaves(values) if not documented(path)]
    assert not undocumented, f"values without ## @param: {undocumented}"

    def exists(path: str) -> bool:
        node = values
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    assert not [p for p in params if not exists(p)], "## @param for keys that do not exist"


def test_schema_covers_every_value():
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())

    def walk(node, schema_node, path):
        if not isinstance(node, dict) or schema_node.get("type") != "object" or "properties" not in schema_node:
            return
        for key, value in node.items():
            assert key in schema_node["properties"], f"{path}{key} missing from values.schema.json"
            walk(value, schema_node["properties"][key], f"{path}{key}.")

    walk(values, schema, "")
