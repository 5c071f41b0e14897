"""Rendering the Helm chart in tests: value sets, a render cache and lookup helpers.

helm-python-sdk renders offline through Helm's Go SDK, bundled in its wheel as a shared
library (libhelm_c): no helm binary, no cluster, no network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip(
    "helm_python",
    reason="helm-python-sdk is not installed (pip install -e '.[test]'); it bundles Helm, no binary needed",
)

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "tandem"
RELEASE = "demo"
NAMESPACE = "llm"

ENGINE = f"{RELEASE}-tandem-engine"
FRONTEND = f"{RELEASE}-tandem-frontend"
HEADLESS = f"{RELEASE}-tandem-engine-headless"

GPU_VALUES: dict[str, Any] = {
    "engine": {
        "device": "cuda",
        "dtype": "bfloat16",
        "gpu": {"count": 1},
        "model": {"pvc": {"claimName": "models"}, "path": "Qwen2.5-7B-Instruct"},
        "image": {"tag": "0.1.0-cuda"},
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "runtimeClassName": "nvidia",
        "kvCache": {"bytes": 40 * 1024**3},
    }
}
SCALE_VALUES: dict[str, Any] = {
    "engine": {"replicaCount": 3, "model": {"pvc": {"claimName": "models"}}},
    "frontend": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8}},
}
TLS_VALUES: dict[str, Any] = {
    "tls": {
        "frontend": {"enabled": True, "existingSecret": "tandem-frontend-tls"},
        "engine": {
            "enabled": True,
            "existingSecret": "tandem-engine-tls",
            "clientExistingSecret": "tandem-frontend-client-tls",
        },
    },
    "frontend": {"auth": {"existingSecret": "tandem-api-keys"}},
}
MONITORING_VALUES: dict[str, Any] = {
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "otel": {"endpoint": "http://otel-collector.observability:4317"},
}
HOSTPATH_VALUES: dict[str, Any] = {
    "engine": {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "path": "llama"}},
    "frontend": {"service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]}},
}
IMAGE_VOLUME_VALUES: dict[str, Any] = {
    "engine": {"model": {"source": "image", "image": {"reference": "registry.example/models/qwen:0.5b"}}},
}

EVERYTHING_VALUES: dict[str, Any] = {
    "commonLabels": {"team": "ml"},
    "commonAnnotations": {"owner": "ml-platform"},
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "tandem@p.iam.gserviceaccount.com"}},
    "otel": {"endpoint": "http://otel:4317", "resourceAttributes": "deployment.environment=prod"},
    "engine": {
        "image": {"registry": "registry.example", "digest": "sha256:" + "a" * 64},
        "model": {"pvc": {"claimName": "models"}},
        "priorityClassName": "inference",
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}},
            }
        ],
        "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "8"}],
        "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        "shm": {"enabled": False},
        "pdb": {"minAvailable": 1},
        "podAnnotations": {"prometheus.io/scrape": "false"},
    },
    "frontend": {
        "service": {"type": "NodePort", "nodePort": 30050, "externalTrafficPolicy": "Local"},
        "autoscaling": {
            "enabled": True,
            "targetMemoryUtilizationPercentage": 80,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
        "preStopSleepSeconds": 0,
        "routing": {"policy": "least-load", "loadThresholdTokens": 4096},
        "workers": 2,
        "extraArgs": ["--tokenizer", "/tokenizer"],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "frontend"}},
                        },
                    }
                ]
            }
        },
    },
    "networkPolicy": {"extraIngress": [{"from": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": [{"port": 9090}]}]},
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": GPU_VALUES,
    "scale": SCALE_VALUES,
    "tls": TLS_VALUES,
    "monitoring": MONITORING_VALUES,
    "hostpath": HOSTPATH_VALUES,
    "everything": EVERYTHING_VALUES,
}


_rendered: dict[str, dict[str, str]] = {}


def _manifests(chart, values: dict[str, Any] | None) -> dict[str, str]:
    key = json.dumps(values or {}, sort_keys=True)
    if key not in _rendered:
        _rendered[key] = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return _rendered[key]


def render(chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart renders for ``values`` (NOTES.txt left out), freshly parsed."""
    objects = []
    for path, text in sorted(_manifests(chart, values).items()):
        if path.endswith(".yaml"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def notes(chart, values: dict[str, Any] | None = None) -> str:
    return next(text for path, text in _manifests(chart, values).items() if path.endswith("NOTES.txt"))


def find(objects, kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def kinds(objects) -> list[tuple[str, str]]:
    return sorted((o["kind"], o["metadata"]["name"]) for o in objects)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> list[str]:
    """Values following every occurrence of ``name`` in an argument list."""
    return [args[i + 1] for i, arg in enumerate(args) if arg == name]


def container_port(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def render_error(chart, values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(info.value)
