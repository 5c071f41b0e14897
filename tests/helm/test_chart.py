"""The Helm chart in helm/tandem, rendered offline: lint, Kubernetes API validity, probes,
engine discovery, the network policy, shutdown timing and GPU resources.

Every rendered object is checked with kubernetes-validate in strict mode (unknown fields are
errors) against the Kubernetes 1.29 and 1.33 API schemas. ServiceMonitor is a Prometheus
Operator CRD with no schema there, so that one kind is skipped in validation and checked by
hand in test_chart_values.py.
"""

from __future__ import annotations

import pytest
import yaml

from tests.helm.rendering import (
    CHART_DIR,
    ENGINE,
    FRONTEND,
    GPU_VALUES,
    HEADLESS,
    HOSTPATH_VALUES,
    IMAGE_VOLUME_VALUES,
    NAMESPACE,
    RELEASE,
    TLS_VALUES,
    VALUE_SETS,
    container,
    container_port,
    find,
    flag,
    helm,
    kinds,
    render,
    render_error,
    selects,
)

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[test]')"
)

KUBE_VERSIONS = ("1.29.0", "1.33.0")
CRD_KINDS = {"ServiceMonitor"}  # no schema in kubernetes-validate; see test_service_monitors


# --------------------------------------------------------------------------- lint and validation


def test_helm_lint_strict():
    report = helm.lint(CHART_DIR, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict_with_values(name):
    report = helm.lint(CHART_DIR, VALUE_SETS[name], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_manifests_valid_for_kubernetes(chart, name, kube_version):
    objects = render(chart, VALUE_SETS[name])
    checked = 0
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for {kube_version}: {exc.message}")
        checked += 1
    assert checked >= 8


def test_image_volume_needs_kubernetes_1_33_schema(chart):
    # The image volume source is not in the 1.29 API at all; from 1.33 it is beta.
    objects = render(chart, IMAGE_VOLUME_VALUES)
    engine = find(objects, "Deployment", ENGINE)
    kubernetes_validate.validate(engine, "1.33.0", strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, "1.29.0", strict=True)
    volumes = {v["name"]: v for v in engine["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["image"]["reference"] == "registry.example/models/qwen:0.5b"


def test_strict_validation_catches_unknown_fields(chart):
    engine = find(render(chart), "Deployment", ENGINE)
    container(engine)["readinessProbe"]["bogus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, "1.33.0", strict=True)


def test_default_objects(chart):
    assert kinds(render(chart)) == sorted(
        [
            ("Deployment", ENGINE),
            ("Deployment", FRONTEND),
            ("NetworkPolicy", ENGINE),
            ("PodDisruptionBudget", ENGINE),
            ("PodDisruptionBudget", FRONTEND),
            ("Service", FRONTEND),
            ("Service", f"{FRONTEND}-metrics"),
            ("Service", HEADLESS),
            ("ServiceAccount", f"{RELEASE}-tandem"),
        ]
    )


# --------------------------------------------------------------------------- probes


@pytest.mark.parametrize("name", ["defaults", "gpu", "scale", "monitoring", "hostpath", "everything"])
def test_probes_are_grpc_on_the_grpc_port(chart, name):
    objects = render(chart, VALUE_SETS[name])
    for deployment_name, port in ((ENGINE, 50051), (FRONTEND, 50050)):
        c = container(find(objects, "Deployment", deployment_name))
        assert container_port(c, "grpc") == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (deployment_name, probe)
            assert "tcpSocket" not in c[probe] and "exec" not in c[probe]


def test_probes_follow_port_changes(chart):
    objects = render(
        chart,
        {"engine": {"containerPorts": {"grpc": 7001}}, "frontend": {"containerPorts": {"grpc": 7000}}},
    )
    engine = container(find(objects, "Deployment", ENGINE))
    frontend = container(find(objects, "Deployment", FRONTEND))
    assert flag(engine["args"], "--port") == ["7001"]
    assert flag(frontend["args"], "--port") == ["7000"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["grpc"]["port"] == 7001
        assert frontend[probe]["grpc"]["port"] == 7000
    assert flag(frontend["args"], "--engine") == [f"dns:///{HEADLESS}.{NAMESPACE}.svc.cluster.local:7001"]


def test_startup_probe_allows_long_model_loading(chart):
    c = container(find(render(chart), "Deployment", ENGINE))
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 20 * 60
    c = container(find(render(chart, {"engine": {"startupProbe": {"failureThreshold": 720}}}), "Deployment", ENGINE))
    assert c["startupProbe"]["failureThreshold"] == 720


def test_tls_ports_use_exec_health_probe(chart):
    # Kubelet's gRPC probe cannot speak TLS, so TLS ports are probed from inside the pod.
    objects = render(chart, TLS_VALUES)
    engine = container(find(objects, "Deployment", ENGINE))
    frontend = container(find(objects, "Deployment", FRONTEND))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = engine[probe]["exec"]["command"]
        assert command[0] == "/usr/local/bin/tandem-health-probe"
        assert flag(command, "--port") == ["50051"]
        assert flag(command, "--cert") == ["/etc/tandem/tls/tls.crt"]  # the engine demands client certs
        assert flag(command, "--server-name") == [f"{HEADLESS}.{NAMESPACE}.svc.cluster.local"]
        command = frontend[probe]["exec"]["command"]
        assert flag(command, "--port") == ["50050"]
        assert flag(command, "--server-name") == [f"{FRONTEND}.{NAMESPACE}.svc.cluster.local"]
        assert "grpc" not in engine[probe] and "grpc" not in frontend[probe]


def test_liveness_can_name_a_health_service(chart):
    values = {"frontend": {"livenessProbe": {"service": "liveness"}}}
    c = container(find(render(chart, values), "Deployment", FRONTEND))
    assert c["livenessProbe"]["grpc"] == {"port": 50050, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": 50050}


def test_liveness_shorter_than_drain_is_rejected(chart):
    # Health reads NOT_SERVING while draining; liveness must not kill a draining pod.
    values = {"engine": {"shutdownTimeout": 300}}
    message = render_error(chart, values)
    assert "engine.livenessProbe" in message and "frontend.livenessProbe" in message
    values["engine"]["livenessProbe"] = {"failureThreshold": 30}
    values["frontend"] = {"livenessProbe": {"failureThreshold": 40}}
    render(chart, values)


# --------------------------------------------------------------------------- engine discovery


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_frontend_engine_address_is_the_headless_service(chart, name):
    objects = render(chart, VALUE_SETS[name])
    headless = find(objects, "Service", HEADLESS)
    engine = find(objects, "Deployment", ENGINE)
    frontend = container(find(objects, "Deployment", FRONTEND))

    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert selects(headless["spec"]["selector"], engine["spec"]["template"]["metadata"]["labels"])
    grpc_port = next(p for p in headless["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == container_port(container(engine), "grpc")

    expected = f"dns:///{HEADLESS}.{NAMESPACE}.svc.cluster.local:{grpc_port['port']}"
    assert flag(frontend["args"], "--engine") == [expected]


def test_cluster_domain_is_configurable(chart):
    frontend = container(find(render(chart, {"clusterDomain": "corp.local"}), "Deployment", FRONTEND))
    assert flag(frontend["args"], "--engine") == [f"dns:///{HEADLESS}.{NAMESPACE}.svc.corp.local:50051"]


def test_frontend_service_is_grpc_only(chart):
    service = find(render(chart), "Service", FRONTEND)
    assert service["spec"]["type"] == "ClusterIP"
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]
    service = find(render(chart, HOSTPATH_VALUES), "Service", FRONTEND)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]  # metrics never public


# --------------------------------------------------------------------------- network policy


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_network_policy_admits_only_frontends_on_engine_port(chart, name):
    objects = render(chart, VALUE_SETS[name])
    policy = find(objects, "NetworkPolicy")
    engine = find(objects, "Deployment", ENGINE)
    frontend = find(objects, "Deployment", FRONTEND)
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    frontend_labels = frontend["spec"]["template"]["metadata"]["labels"]
    engine_port = container_port(container(engine), "grpc")
    metrics_port = container_port(container(engine), "metrics")

    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert selects(spec["podSelector"]["matchLabels"], engine_labels)
    assert not selects(spec["podSelector"]["matchLabels"], frontend_labels)

    rules_for_grpc = []
    for rule in spec["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        assert ports, "a rule without ports would open every port"
        if engine_port in ports:
            rules_for_grpc.append(rule)
        else:
            assert ports == [metrics_port]
    assert len(rules_for_grpc) == 1
    (rule,) = rules_for_grpc
    assert rule["ports"] == [{"port": engine_port, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # same namespace only, no namespaceSelector / ipBlock
    assert selects(peer["podSelector"]["matchLabels"], frontend_labels)
    assert not selects(peer["podSelector"]["matchLabels"], engine_labels)


def test_network_policy_metrics_peers_are_configurable(chart):
    peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app": "prometheus"}},
    }
    policy = find(render(chart, {"networkPolicy": {"metrics": {"from": [peer]}}}), "NetworkPolicy")
    (metrics_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 9090]
    assert metrics_rule["from"] == [peer]

    policy = find(render(chart, {"networkPolicy": {"metrics": {"from": []}}}), "NetworkPolicy")
    (metrics_rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 9090]
    assert "from" not in metrics_rule  # any source, metrics port only

    policy = find(render(chart, {"metrics": {"enabled": False}}), "NetworkPolicy")
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == [50051]
    assert not [o for o in render(chart, {"networkPolicy": {"enabled": False}}) if o["kind"] == "NetworkPolicy"]


# --------------------------------------------------------------------------- shutdown


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_grace_period_exceeds_shutdown_timeout(chart, name):
    objects = render(chart, VALUE_SETS[name])
    engine = find(objects, "Deployment", ENGINE)
    shutdown = int(flag(container(engine)["args"], "--shutdown-timeout")[0])
    assert engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > shutdown
    frontend = find(objects, "Deployment", FRONTEND)
    assert frontend["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > shutdown


def test_grace_period_follows_shutdown_timeout(chart):
    objects = render(
        chart,
        {
            "engine": {"shutdownTimeout": 120, "livenessProbe": {"failureThreshold": 10}},
            "frontend": {"livenessProbe": {"failureThreshold": 15}},
        },
    )
    engine = find(objects, "Deployment", ENGINE)
    assert flag(container(engine)["args"], "--shutdown-timeout") == ["120"]
    assert engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 135


def test_grace_period_not_above_shutdown_timeout_is_rejected(chart):
    message = render_error(chart, {"engine": {"shutdownTimeout": 60, "terminationGracePeriodSeconds": 60}})
    assert "engine.terminationGracePeriodSeconds" in message and "must exceed" in message


# --------------------------------------------------------------------------- GPU


def test_gpu_resources_only_with_cuda(chart):
    for name, values in VALUE_SETS.items():
        objects = render(chart, values)
        engine = container(find(objects, "Deployment", ENGINE))
        frontend = container(find(objects, "Deployment", FRONTEND))
        assert "nvidia.com/gpu" not in yaml.safe_dump(frontend)
        limits = engine.get("resources", {}).get("limits", {})
        if values.get("engine", {}).get("device") == "cuda":
            assert limits["nvidia.com/gpu"] == 1, name
            assert flag(engine["args"], "--device") == ["cuda"]
        else:
            assert "nvidia.com/gpu" not in yaml.safe_dump(engine), name
            assert flag(engine["args"], "--device") == ["cpu"]


def test_gpu_scheduling_settings(chart):
    objects = render(chart, GPU_VALUES)
    pod = find(objects, "Deployment", ENGINE)["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == GPU_VALUES["engine"]["nodeSelector"]
    assert pod["tolerations"] == GPU_VALUES["engine"]["tolerations"]
    c = pod["containers"][0]
    assert c["image"] == "tandem/engine:0.1.0-cuda"
    assert c["resources"]["limits"]["memory"] == "16Gi"  # the GPU is added, nothing replaced
    assert flag(c["args"], "--dtype") == ["bfloat16"]
    assert flag(c["args"], "--kv-cache-bytes") == [str(40 * 1024**3)]  # not 4.294967296e+10
    frontend = find(objects, "Deployment", FRONTEND)["spec"]["template"]["spec"]
    assert "runtimeClassName" not in frontend and "tolerations" not in frontend


def test_gpu_resource_name_is_configurable(chart):
    values = {"engine": {"device": "cuda", "gpu": {"resourceName": "nvidia.com/mig-3g.40gb"}}}
    c = container(find(render(chart, values), "Deployment", ENGINE))
    assert c["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == 1
    assert "nvidia.com/gpu" not in c["resources"]["limits"]


def test_frontend_http_port_is_opt_in_with_a_health_readiness_probe(chart):
    values = {"frontend": {"http": {"enabled": True}}}
    objects = render(chart, values)
    frontend = container(find(objects, "Deployment", FRONTEND))
    assert flag(frontend["args"], "--http-port") == ["8000"] and container_port(frontend, "http") == 8000
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    assert frontend["livenessProbe"]["grpc"]["port"] == 50050  # liveness stays on gRPC health
    service = find(objects, "Service", FRONTEND)
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("grpc", 50050), ("http", 8000)]
    tls = {**TLS_VALUES, **values}
    frontend = container(find(render(chart, tls), "Deployment", FRONTEND))
    assert frontend["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert "--http-port" not in container(find(render(chart), "Deployment", FRONTEND))["args"]
