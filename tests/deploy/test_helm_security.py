"""A Kubernetes security review of deploy/helm/kvtier, with the real tools.

- kubernetes-validate checks every rendered manifest against the Kubernetes API
  schemas of the oldest version the chart supports (Chart.yaml kubeVersion) and two
  newer ones, strictly (unknown fields are errors);
- checkov scans the rendered chart: no failed check, and every skipped one is skipped
  in the chart itself (a checkov.io/skipN annotation with its reason) and only while
  its reason holds;
- a real redis-server runs the in-chart Redis' rendered config and ACL script, and
  kvtier's RedisTier talks to it with the URL the chart builds (plain and TLS);
- a fake API server lets the real helm `lookup` the Redis password of an earlier
  install, and renders NOTES through `helm install --dry-run=server`;
- the rest reads the manifests: security contexts, writable directories, secrets
  never on a command line, NetworkPolicy selectors, the HMAC requirement.

checkov and kubernetes-validate run as commands from the environment running the tests
(or, for checkov, the repository's .tools/scan venv); a missing tool fails the test, it
never skips.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from kit import free_port
from redis.backoff import NoBackoff
from redis.retry import Retry
from test_helm import (
    CHART,
    ROOT,
    SECRETS,
    VALUE_SETS,
    cluster_env,
    find_helm,
    transfer_config,
)

from kvtier.config import load_config
from kvtier.objects.tiers.redis import RedisTier

pytestmark = pytest.mark.integration

# Chart.yaml's kubeVersion floor, and two newer releases
KUBERNETES_VERSIONS = ["1.25.0", "1.30.0", "1.34.0"]

HMAC = {"existingSecret": "kvtier-hmac-3a8f"}
MONITORING = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "podMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
}
DIGEST = "sha256:" + "0123456789abcdef" * 4

# name -> (release, namespace, values). Each scenario is its own release in its own
# namespace, so that checkov's graph checks never pair one render's NetworkPolicy
# with another render's pods.
SCENARIOS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "default": ("rel", "llm", {}),
    # the in-chart Redis with TLS, monitoring, a PDB, its own ServiceAccount and
    # restricted egress: everything the chart can render at once
    "in-chart-redis": (
        "cache",
        "llm-redis",
        {
            "redis": {"enabled": True, "tls": {"enabled": True, "existingSecret": "redis-tls"}},
            "kvtier": {"hmac": HMAC},
            "monitoring": MONITORING,
            "podDisruptionBudget": {"enabled": True},
            "serviceAccount": {"create": True},
            "networkPolicy": {
                "ingressFrom": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}
                ],
                "egress": {"restrict": True},
            },
        },
    ),
    # an external S3 tier with keys (and the encryption key) from Secrets, monitoring and
    # egress rules to it
    # (the chart refuses the in-chart Redis and kvtier.remoteUrl together)
    "s3": (
        "objects",
        "llm-s3",
        {
            "replicaCount": 3,
            "kvtier": {
                "remoteUrl": "s3://kv-cache/prod",
                "s3": {"endpointUrl": "https://s3.internal:9000", "existingSecret": "s3-keys"},
                "hmac": HMAC,
                "encryption": {"existingSecret": "kvtier-encryption-5d2c"},
            },
            "monitoring": MONITORING,
            "networkPolicy": {
                "egress": {
                    "restrict": True,
                    "rules": [
                        {
                            "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
                            "ports": [{"port": 9000, "protocol": "TCP"}],
                        }
                    ],
                }
            },
        },
    ),
    # an external Redis Cluster over TLS: seed nodes, an ACL user's password from a Secret,
    # the CA from a Secret volume, egress to the cluster's nodes
    "redis-cluster": (
        "rcluster",
        "llm-rcluster",
        {
            "kvtier": {
                "remoteUrl": "rediss+cluster://rc-0.rc.cache.svc:6379,rc-1.rc.cache.svc:6379/"
                "?ssl_ca_certs=/etc/kvtier/redis-ca/ca.crt",
                "redis": {"existingSecret": "kvtier-redis-auth-9b2d", "username": "kvtier"},
                "hmac": HMAC,
            },
            "extraVolumes": [{"name": "redis-ca", "secret": {"secretName": "rc-ca"}}],
            "extraVolumeMounts": [
                {"name": "redis-ca", "mountPath": "/etc/kvtier/redis-ca", "readOnly": True}
            ],
            "networkPolicy": {
                "egress": {
                    "restrict": True,
                    "rules": [
                        {
                            "to": [
                                {
                                    "namespaceSelector": {
                                        "matchLabels": {"kubernetes.io/metadata.name": "cache"}
                                    }
                                }
                            ],
                            "ports": [{"port": 6379, "protocol": "TCP"}],
                        }
                    ],
                }
            },
        },
    ),
    # every skip's condition lifted but one: digests, CPU limits, the HMAC key as a
    # file (the Redis password still reaches kvtier through the environment)
    "pinned": (
        "pinned",
        "llm-pinned",
        {
            "image": {"repository": "registry.example.com/vllm-kvtier", "digest": DIGEST},
            "resources": {"limits": {"cpu": "8", "memory": "64Gi"}},
            "redis": {
                "enabled": True,
                "existingSecret": "kvtier-inchart-redis-4f5a",
                "image": {"digest": DIGEST},
                "resources": {"limits": {"cpu": "2", "memory": "9Gi"}},
            },
            "kvtier": {
                "allowUnsignedChunks": True,
                # kvtier reads the key from a file (no secret in the environment)
                "extraConfig": {"hmac_key_file": "/etc/kvtier/hmac/hmac-key"},
            },
            "extraVolumes": [{"name": "hmac", "secret": {"secretName": "kvtier-hmac-3a8f"}}],
            "extraVolumeMounts": [
                {"name": "hmac", "mountPath": "/etc/kvtier/hmac", "readOnly": True}
            ],
        },
    ),
}

# Every check the chart may skip, and what must hold for the skip to be there.
ALLOWED_SKIPS = {
    "CKV_K8S_11": "no CPU limit (resources.limits.cpu / redis.resources.limits.cpu)",
    "CKV_K8S_43": "no image digest (image.digest / redis.image.digest)",
    "CKV_K8S_15": "no digest and imagePullPolicy is not Always",
    "CKV_K8S_35": "a secretKeyRef in the vLLM container's environment",
}

# checks each workload must have passed (so a scan that skipped them is caught)
MUST_PASS = {
    "CKV_K8S_8",  # liveness probe
    "CKV_K8S_9",  # readiness probe
    "CKV_K8S_12",  # memory requests
    "CKV_K8S_13",  # memory limits
    "CKV_K8S_14",  # image tag fixed
    "CKV_K8S_16",  # not privileged
    "CKV_K8S_20",  # allowPrivilegeEscalation false
    "CKV_K8S_21",  # not the default namespace
    "CKV_K8S_22",  # read-only root file system
    "CKV_K8S_23",  # not root
    "CKV_K8S_28",  # no NET_RAW
    "CKV_K8S_29",  # pod securityContext
    "CKV_K8S_30",  # container securityContext
    "CKV_K8S_31",  # seccomp RuntimeDefault
    "CKV_K8S_37",  # capabilities dropped
    "CKV_K8S_38",  # no service account token
    "CKV_K8S_40",  # a high UID
}


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def helm() -> str:
    return find_helm()


# Where the scanners are looked for: next to the Python running the tests (the test
# extras), then the repository's own tool environment (`make` builds .tools/scan, a
# separate venv for checkov, whose pinned dependencies clash with vLLM's).
TOOL_DIRS = [Path(sys.executable).parent, ROOT / ".tools" / "scan" / "bin"]


def tool(name: str) -> str:
    for directory in TOOL_DIRS:
        if os.access(directory / name, os.X_OK):
            return str(directory / name)
    pytest.fail(
        f"{name} is in none of {', '.join(map(str, TOOL_DIRS))}: install the test extras "
        "(kubernetes-validate) and the scan tools (checkov in .tools/scan; see the Makefile)",
        pytrace=False,
    )


_RENDERS: dict[str, subprocess.CompletedProcess] = {}


def helm_template(
    helm: str,
    values: dict[str, Any],
    tmp: Path,
    release: str = "rel",
    namespace: str = "llm",
    flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    key = json.dumps([release, namespace, values, flags], sort_keys=True)
    if key not in _RENDERS:
        vfile = tmp / f"values-{len(_RENDERS)}.yaml"
        vfile.write_text(yaml.safe_dump(values))
        _RENDERS[key] = subprocess.run(
            [helm, "template", release, str(CHART), "-n", namespace, "-f", str(vfile), *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
    return _RENDERS[key]


def render(helm: str, values: dict[str, Any], tmp: Path, **kw: Any) -> list[dict[str, Any]]:
    out = helm_template(helm, values, tmp, **kw)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_fails(helm: str, values: dict[str, Any], tmp: Path, flags: tuple[str, ...] = ()) -> str:
    out = helm_template(helm, values, tmp, flags=flags)
    assert out.returncode != 0, f"helm template accepted {values}"
    return out.stderr


def scenario(helm: str, name: str, tmp: Path) -> list[dict[str, Any]]:
    release, namespace, values = SCENARIOS[name]
    return render(helm, values, tmp, release=release, namespace=namespace)


def kind(docs: list[dict[str, Any]], k: str, component: str | None = None) -> list[dict]:
    return [
        d
        for d in docs
        if d["kind"] == k
        and (
            component is None
            or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        )
    ]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(deployment)
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are expected"
    return selector.get("matchLabels", {}).items() <= labels.items()


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


@pytest.fixture(scope="module")
def rendered(helm, tmp_path_factory) -> Path:
    """Every scenario and every value set of test_helm.py rendered to one directory."""
    out = tmp_path_factory.mktemp("rendered")
    tmp = tmp_path_factory.mktemp("values")
    for name, (release, namespace, values) in SCENARIOS.items():
        text = helm_template(helm, values, tmp, release=release, namespace=namespace)
        assert text.returncode == 0, text.stderr
        (out / f"scenario-{name}.yaml").write_text(text.stdout)
    for name, values in VALUE_SETS.items():
        text = helm_template(helm, values, tmp, release=f"vs-{name}", namespace=f"vs-{name}")
        assert text.returncode == 0, text.stderr
        (out / f"values-{name}.yaml").write_text(text.stdout)
    return out


# ---------------------------------------------------------------- kubernetes-validate


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_api(rendered, version):
    files = sorted(rendered.glob("*.yaml"))
    out = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", version, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    passed = set(re.findall(r"(\S+\.yaml) passed for resource (\S+) against", report))
    no_schema = re.findall(r"Couldn't find schema for kind (\w+) with api version (\S+)", report)
    # only the Prometheus operator's CRDs have no Kubernetes schema
    assert {api for _, api in no_schema} <= {"monitoring.coreos.com/v1"}, no_schema
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc or doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            resource = f"{doc['kind'].lower()}/{doc['metadata']['name']}"
            assert (f.name, resource) in passed or (str(f), resource) in passed, (
                f"{f.name}: {resource} was not validated against {version}\n{report}"
            )


def test_kubernetes_validate_rejects_what_the_api_server_would(tmp_path):
    """The validator is not a no-op: a wrong type and a misspelt field both fail."""

    def deployment(name: str, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": {"a": "b"}},
                "template": {
                    "metadata": {"labels": {"a": "b"}},
                    "spec": {**pod, "containers": [{"name": "c", "image": "i", **container}]},
                },
            },
        }

    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump_all(
            [
                deployment("wrong-type", {"securityContext": {"runAsUser": "root"}}, {}),
                deployment("misspelt", {}, {"securityContext": {"readOnlyRootFilesytem": True}}),
            ]
        )
    )
    out = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[0], str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = out.stdout + out.stderr
    assert out.returncode != 0
    assert re.search(r"deployment/wrong-type.*runAsUser", report), report
    assert re.search(r"deployment/misspelt.*readOnlyRootFilesytem", report), report


# ---------------------------------------------------------------- checkov


@pytest.fixture(scope="module")
def checkov(helm, tmp_path_factory) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """One checkov run over every scenario's render: {scenario: {passed, failed, skipped}}."""
    out_dir = tmp_path_factory.mktemp("checkov")
    tmp = tmp_path_factory.mktemp("checkov-values")
    for name in SCENARIOS:
        release, namespace, values = SCENARIOS[name]
        text = helm_template(helm, values, tmp, release=release, namespace=namespace)
        assert text.returncode == 0, text.stderr
        (out_dir / f"{name}.yaml").write_text(text.stdout)
    out = subprocess.run(
        [
            tool("checkov"),
            "--framework",
            "kubernetes",
            "-d",
            str(out_dir),
            "-o",
            "json",
            "--skip-download",
        ],  # offline: no Prisma Cloud guidelines or mappings
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode in (0, 1), out.stderr  # 1: failed checks, reported below
    report = json.loads(out.stdout)
    assert isinstance(report, dict), f"checkov found nothing to scan: {out.stdout[:500]}"
    assert report["check_type"] == "kubernetes"
    assert report["summary"]["parsing_errors"] == 0, report["results"].get("parsing_errors")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"passed": [], "failed": [], "skipped": []} for name in SCENARIOS
    }
    for outcome in ("passed", "failed", "skipped"):
        for check in report["results"].get(f"{outcome}_checks", []):
            results[Path(check["file_path"]).stem][outcome].append(check)
    return results


def _summary(checks: list[dict[str, Any]]) -> list[str]:
    return [f"{c['check_id']} {c['check_name']} on {c['resource']}" for c in checks]


@pytest.mark.parametrize("name", SCENARIOS)
def test_checkov_has_no_failed_checks(checkov, name):
    assert not checkov[name]["failed"], "\n".join(_summary(checkov[name]["failed"]))


@pytest.mark.parametrize("name", SCENARIOS)
def test_checkov_ran_the_security_checks_on_every_workload(checkov, helm, tmp_path, name):
    docs = scenario(helm, name, tmp_path)
    passed = checkov[name]["passed"]
    for dep in kind(docs, "Deployment"):
        resource = f"Deployment.{dep['metadata']['namespace']}.{dep['metadata']['name']}"
        skipped = {c["check_id"] for c in checkov[name]["skipped"] if c["resource"] == resource}
        done = {c["check_id"] for c in passed if c["resource"] == resource}
        assert MUST_PASS - skipped <= done, (resource, sorted(MUST_PASS - done))
    # the graph check: every pod has a NetworkPolicy
    netpol = [c["resource"] for c in passed if c["check_id"] == "CKV2_K8S_6"]
    assert len(netpol) == len(kind(docs, "Deployment")), netpol


def test_checkov_skips_are_in_the_chart_with_a_reason(checkov):
    seen = set()
    for name, outcome in checkov.items():
        for check in outcome["skipped"]:
            cid, reason = check["check_id"], check["check_result"].get("suppress_comment", "")
            assert cid in ALLOWED_SKIPS, f"{name}: {cid} skipped on {check['resource']}"
            assert reason != "No comment provided" and len(reason) > 40, (cid, reason)
            seen.add(cid)
    assert seen == set(ALLOWED_SKIPS), "a skip no scenario exercises: drop it from ALLOWED_SKIPS"


def test_checkov_skips_hold_only_while_their_reason_does(checkov):
    def skipped(name: str) -> set[tuple[str, str]]:
        return {(c["check_id"], c["resource"]) for c in checkov[name]["skipped"]}

    # defaults: a tag without a digest pulled IfNotPresent, no CPU limit
    assert skipped("default") == {
        ("CKV_K8S_11", "Deployment.llm.rel-kvtier"),
        ("CKV_K8S_15", "Deployment.llm.rel-kvtier"),
        ("CKV_K8S_43", "Deployment.llm.rel-kvtier"),
    }
    # keys from secretKeyRef in the environment: S3 keys, Redis password, HMAC key
    assert ("CKV_K8S_35", "Deployment.llm-s3.objects-kvtier") in skipped("s3")
    assert ("CKV_K8S_35", "Deployment.llm-redis.cache-kvtier") in skipped("in-chart-redis")
    assert ("CKV_K8S_43", "Deployment.llm-redis.cache-kvtier-redis") in skipped("in-chart-redis")
    # digests and CPU limits set: those checks pass; only the Redis password in env is left
    assert skipped("pinned") - {("CKV_K8S_35", "Deployment.llm-pinned.pinned-kvtier")} == set()
    passed = {(c["check_id"], c["resource"]) for c in checkov["pinned"]["passed"]}
    for dep in ("pinned-kvtier", "pinned-kvtier-redis"):
        for cid in ("CKV_K8S_11", "CKV_K8S_15", "CKV_K8S_43"):
            assert (cid, f"Deployment.llm-pinned.{dep}") in passed


# ---------------------------------------------------------------- pods


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_pod_is_locked_down(helm, tmp_path, name):
    docs = scenario(helm, name, tmp_path)
    for dep in kind(docs, "Deployment"):
        spec = pod_spec(dep)
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host)
        assert not [v for v in spec["volumes"] if "hostPath" in v]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True
        assert isinstance(psc["runAsUser"], int) and psc["runAsUser"] >= 10000
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(dep):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000, c["name"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["privileged"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]
            assert not [p for p in c.get("ports", []) if "hostPort" in p]
    for sa in kind(docs, "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False
    # every namespaced object names its namespace (kubectl apply of a render lands there)
    _, namespace, _ = SCENARIOS[name]
    for d in docs:
        assert d["metadata"]["namespace"] == namespace, d["metadata"]["name"]


def test_vllm_writes_only_to_its_own_volumes(helm, tmp_path):
    docs = scenario(helm, "default", tmp_path)
    (dep,) = kind(docs, "Deployment", "vllm")
    (c,) = pod_spec(dep)["containers"]
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    writable = [p for p, m in mounts.items() if not m.get("readOnly")]
    assert {"/tmp", "/home/vllm", "/home/vllm/.cache/huggingface", "/dev/shm"} <= set(writable)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env["HOME"] == "/home/vllm" and env["USER"]
    for var in (
        "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME",
        "HF_HOME",
        "VLLM_CACHE_ROOT",
        "VLLM_CONFIG_ROOT",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
    ):
        assert any(env[var] == p or env[var].startswith(p + "/") for p in writable), var
    assert env["HF_HOME"] == "/home/vllm/.cache/huggingface"
    for name in ("tmp", "home", "hf-cache"):
        assert volumes[name]["emptyDir"]["sizeLimit"]
    # a PVC for the Hugging Face cache, and a different HOME
    values = {"writableDirs": {"home": {"path": "/work"}, "hfCache": {"existingClaim": "hf"}}}
    (dep,) = kind(render(helm, values, tmp_path), "Deployment", "vllm")
    (c,) = pod_spec(dep)["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env["HOME"] == "/work" and env["TRITON_CACHE_DIR"] == "/work/.cache/triton"
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    assert volumes["hf-cache"] == {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf"}}
    # an image that needs root: the user says so explicitly, and the chart follows
    root = {
        "podSecurityContext": {"runAsNonRoot": False, "runAsUser": 0},
        "securityContext": {"runAsNonRoot": False, "runAsUser": 0, "readOnlyRootFilesystem": None},
    }
    (dep,) = kind(render(helm, root, tmp_path), "Deployment", "vllm")
    sc = pod_spec(dep)["containers"][0]["securityContext"]
    assert sc["runAsUser"] == 0 and "readOnlyRootFilesystem" not in sc
    assert sc["capabilities"] == {"drop": ["ALL"]}


def test_image_tag_defaults_to_the_app_version(helm, tmp_path):
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    (dep,) = kind(scenario(helm, "default", tmp_path), "Deployment", "vllm")
    # the image the repository's Dockerfile builds, tagged as the chart README says
    assert pod_spec(dep)["containers"][0]["image"] == f"kvtier:{app_version}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == "" and values["redis"]["image"]["tag"] != "latest"
    docs = scenario(helm, "pinned", tmp_path)
    (dep,) = kind(docs, "Deployment", "vllm")
    image = pod_spec(dep)["containers"][0]["image"]
    assert image == f"registry.example.com/vllm-kvtier:{app_version}@{DIGEST}"
    (dep,) = kind(docs, "Deployment", "redis")
    assert {c["image"] for c in containers(dep)} == {f"redis:7.4-alpine@{DIGEST}"}
    err = render_fails(helm, {"image": {"digest": "latest"}}, tmp_path)
    assert "image.digest: Does not match pattern" in err


# ---------------------------------------------------------------- the in-chart Redis


def redis_parts(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = kind(docs, "Deployment", "redis")
    spec = pod_spec(dep)
    (init,) = spec["initContainers"]
    (server,) = spec["containers"]
    (cm,) = kind(docs, "ConfigMap", "redis")
    return {
        "deployment": dep,
        "spec": spec,
        "init": init,
        "server": server,
        "conf": cm["data"]["redis.conf"],
    }


@pytest.mark.parametrize(
    "values",
    [
        {"redis": {"enabled": True}, "kvtier": {"hmac": HMAC}},
        {
            "redis": {"enabled": True, "existingSecret": "kvtier-inchart-redis-4f5a"},
            "kvtier": {"hmac": HMAC},
        },
        {
            "redis": {"enabled": True, "tls": {"enabled": True, "existingSecret": "t"}},
            "kvtier": {"hmac": HMAC},
        },
    ],
    ids=["generated", "existing-secret", "tls"],
)
def test_redis_password_is_never_on_a_command_line(helm, tmp_path, values):
    out = helm_template(helm, values, tmp_path)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    r = redis_parts(docs)
    secret_name = values["redis"].get("existingSecret") or "rel-kvtier-redis-auth"
    generated = kind(docs, "Secret")
    if values["redis"].get("existingSecret"):
        assert not generated
        passwords = [SECRETS[secret_name]["redis-password"]]
    else:
        (secret,) = generated
        assert secret["metadata"]["name"] == secret_name
        password = base64.b64decode(secret["data"]["redis-password"]).decode()
        assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
        passwords = [password, secret["data"]["redis-password"]]
    # redis-server reads its config file; the config names the ACL file
    assert r["server"]["command"] == ["redis-server", "/etc/redis/conf/redis.conf"]
    assert "args" not in r["server"] and "env" not in r["server"]
    assert "aclfile /run/redis/users.acl" in r["conf"] and "requirepass" not in r["conf"]
    # only the init container sees the Secret, as a file
    auth = [
        m
        for c in containers(r["deployment"])
        for m in c.get("volumeMounts", [])
        if m["name"] == "auth"
    ]
    assert [m["mountPath"] for m in r["init"]["volumeMounts"] if m["name"] == "auth"] == [
        "/etc/redis/auth"
    ] and len(auth) == 1
    (vol,) = [v for v in r["spec"]["volumes"] if v["name"] == "auth"]
    assert vol["secret"]["secretName"] == secret_name
    (run,) = [v for v in r["spec"]["volumes"] if v["name"] == "run"]
    assert run["emptyDir"]["medium"] == "Memory"
    # vLLM reads the same Secret; the password is in no argv, no env value, no other object
    (vllm,) = kind(docs, "Deployment", "vllm")
    env = pod_spec(vllm)["containers"][0]["env"]
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in env if e["name"] == "REDIS_PASSWORD"]
    assert ref == {"name": secret_name, "key": "redis-password"}
    for d in docs:
        text = yaml.safe_dump(d)
        for pw in passwords:
            if d["kind"] != "Secret":
                assert pw not in text, f"the password is in {d['kind']} {d['metadata']['name']}"
        for dep in kind([d], "Deployment"):
            for c in containers(dep):
                argv = " ".join(c.get("command", []) + c.get("args", []))
                assert "requirepass" not in argv and "$(REDIS_PASSWORD)" not in argv
                for e in c.get("env", []):
                    assert "value" not in e or not any(pw in e["value"] for pw in passwords)


def test_the_generated_password_is_kept_across_upgrades(helm, tmp_path, fake_api):
    """helm looks the Secret of an earlier install up (lookup) instead of generating anew."""
    values = {"redis": {"enabled": True}, "kvtier": {"hmac": HMAC}}

    def password(*extra: str) -> str:
        vfile = tmp_path / "v.yaml"
        vfile.write_text(yaml.safe_dump(values))
        out = subprocess.run(
            [
                helm,
                "template",
                "rel",
                str(CHART),
                "-n",
                "llm",
                "-f",
                str(vfile),
                "--show-only",
                "templates/redis.yaml",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        (secret,) = kind([d for d in yaml.safe_load_all(out.stdout) if d], "Secret")
        return base64.b64decode(secret["data"]["redis-password"]).decode()

    # no cluster: a fresh random password every time
    assert password() != password()
    # the API server has the Secret from the first install: the same password again
    fake_api.secrets[("llm", "rel-kvtier-redis-auth")] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "rel-kvtier-redis-auth", "namespace": "llm"},
        "data": {"redis-password": base64.b64encode(b"KeptFromTheFirstInstall1").decode()},
    }
    server = ["--kubeconfig", str(fake_api.kubeconfig), "--dry-run=server"]
    assert password(*server) == password(*server) == "KeptFromTheFirstInstall1"
    assert "/api/v1/namespaces/llm/secrets/rel-kvtier-redis-auth" in fake_api.requests


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _tls_secret(directory: Path, dns_name: str) -> None:
    """tls.crt / tls.key / ca.crt as cert-manager writes them: a CA and a server
    certificate it signed for the Service name (and 127.0.0.1, where the test dials)."""
    directory.mkdir()
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=kvtier-test-ca",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca_crt),
    )
    csr = directory / "tls.csr"
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-subj",
        f"/CN={dns_name}",
        "-keyout",
        str(directory / "tls.key"),
        "-out",
        str(csr),
    )
    ext = directory / "san.ext"
    ext.write_text(f"subjectAltName=DNS:{dns_name},IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca_crt),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(ext),
        "-out",
        str(directory / "tls.crt"),
    )
    ca_key.unlink()


class _Pod:
    """The in-chart Redis pod on this machine: its volumes are directories under root."""

    def __init__(self, root: Path, spec: dict[str, Any], password: str) -> None:
        self.root = root
        root.mkdir(parents=True)
        self.paths: dict[str, Path] = {}
        for c in spec["initContainers"] + spec["containers"]:
            for m in c["volumeMounts"]:
                self.paths[m["mountPath"]] = root / m["name"]
                (root / m["name"]).mkdir(exist_ok=True)
        (vol,) = [v for v in spec["volumes"] if v["name"] == "auth"]
        for item in vol["secret"]["items"]:
            (root / "auth" / item["path"]).write_text(password)

    def local(self, text: str) -> str:
        """The text with every mount path replaced by its directory here."""
        mounts = sorted(self.paths, key=len, reverse=True)
        pattern = "|".join(re.escape(m) for m in mounts)
        return re.sub(pattern, lambda m: str(self.paths[m.group(0)]), text)


def run_init(pod: _Pod, init: dict[str, Any]) -> subprocess.CompletedProcess:
    env = {e["name"]: e["value"] for e in init["env"]}
    return subprocess.run(
        [init["command"][0], init["command"][1], pod.local(init["command"][2])],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture
def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not on PATH: install it with `apt-get install -y redis-server` "
            "(.ci/run does this)",
            pytrace=False,
        )
    return binary


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_in_chart_redis_runs_its_rendered_config(helm, tmp_path, redis_server_binary, tls):
    """The init script, redis.conf and the URL kvtier gets, run for real: redis-server
    asks for the password, refuses @dangerous commands, and kvtier's RedisTier works."""
    secret = "kvtier-inchart-redis-4f5a"
    password = SECRETS[secret]["redis-password"]
    values: dict[str, Any] = {
        "redis": {"enabled": True, "existingSecret": secret},
        "kvtier": {"hmac": HMAC},
    }
    if tls:
        values["redis"]["tls"] = {"enabled": True, "existingSecret": "redis-tls"}
    docs = render(helm, values, tmp_path)
    r = redis_parts(docs)
    pod = _Pod(tmp_path / "pod", r["spec"], password)

    init = run_init(pod, r["init"])
    assert init.returncode == 0, init.stderr
    acl = pod.paths["/run/redis"] / "users.acl"
    assert acl.stat().st_mode & 0o077 == 0, "the ACL file must be private to Redis' user"
    assert acl.read_text().startswith(f"user default on >{password} ")

    port = free_port()
    conf = pod.local(r["conf"]).replace("bind * -::*", "bind 127.0.0.1")
    conf = re.sub(r"^(tls-)?port 6379$", rf"\g<1>port {port}", conf, flags=re.M)
    conf_file = pod.paths["/etc/redis/conf"] / "redis.conf"
    conf_file.write_text(conf)
    if tls:
        shutil.rmtree(pod.paths["/etc/redis/tls"])
        _tls_secret(pod.paths["/etc/redis/tls"], "rel-kvtier-redis")
    argv = [pod.local(a) for a in r["server"]["command"]]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
        assert password.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()

        # the URL kvtier uses: --kv-transfer-config with the environment Kubernetes builds
        (vllm,) = kind(docs, "Deployment", "vllm")
        container = pod_spec(vllm)["containers"][0]
        extra = transfer_config(container)["kv_connector_extra_config"]
        url = load_config(extra, environ=cluster_env(container)).remote_url
        assert password in url and password not in json.dumps(extra)
        assert url.startswith("rediss://" if tls else "redis://")
        url = url.replace("@rel-kvtier-redis:6379/", f"@127.0.0.1:{port}/")
        if tls:
            ca_mount = "/etc/kvtier/redis-tls"
            (vol,) = [v for v in pod_spec(vllm)["volumes"] if v["name"] == "redis-ca"]
            assert vol["secret"] == {
                "secretName": "redis-tls",
                "items": [{"key": "ca.crt", "path": "ca.crt"}],
            }
            assert f"ssl_ca_certs={ca_mount}/ca.crt" in url
            url = url.replace(ca_mount, str(pod.paths["/etc/redis/tls"]))
        tier = RedisTier(url)
        try:
            tier.put("kvtier-test-key", [b"header", b"payload"])
            assert tier.get("kvtier-test-key") == b"headerpayload"
            assert tier.exists(["kvtier-test-key", "missing"]) == [True, False]
            tier.delete(["kvtier-test-key"])
            assert tier.get("kvtier-test-key") is None
        finally:
            tier.close()

        # no retries: redis-py retries a refused AUTH (a ConnectionError) with backoff
        client: dict[str, Any] = {"host": "127.0.0.1", "port": port, "retry": Retry(NoBackoff(), 0)}
        if tls:
            client.update(ssl=True, ssl_ca_certs=str(pod.paths["/etc/redis/tls"] / "ca.crt"))
        anonymous = redis.Redis(**client)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")
        anonymous.close()
        user = redis.Redis(password=password, **client)
        assert user.ping()
        for dangerous in (lambda: user.config_get("*"), user.flushall, lambda: user.keys("*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                dangerous()
        user.close()
        if tls:  # no plain TCP next to TLS
            plain = redis.Redis(
                host="127.0.0.1",
                port=port,
                password=password,
                socket_timeout=2,
                retry=Retry(NoBackoff(), 0),
            )
            with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
                plain.ping()
            plain.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("bad", ["has space", "p@ss:word", ""])
def test_redis_refuses_a_password_it_cannot_put_in_a_url(helm, tmp_path, bad):
    docs = render(helm, {"redis": {"enabled": True}, "kvtier": {"hmac": HMAC}}, tmp_path)
    r = redis_parts(docs)
    pod = _Pod(tmp_path / "pod", r["spec"], bad)
    out = run_init(pod, r["init"])
    assert out.returncode != 0
    assert "is empty or holds characters other than" in out.stderr
    assert not (pod.paths["/run/redis"] / "users.acl").exists()


def test_redis_tls_needs_a_certificate_secret(helm, tmp_path):
    err = render_fails(
        helm,
        {"redis": {"enabled": True, "tls": {"enabled": True}}, "kvtier": {"hmac": HMAC}},
        tmp_path,
    )
    assert "redis.tls.existingSecret is required with redis.tls.enabled" in err


# ---------------------------------------------------------------- NetworkPolicies


def test_only_the_vllm_pods_reach_redis(helm, tmp_path):
    docs = scenario(helm, "in-chart-redis", tmp_path)
    deployments = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in kind(docs, "Deployment")
    }
    policies = {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p
        for p in kind(docs, "NetworkPolicy")
    }
    assert set(policies) == {"redis", "vllm"}
    for component, policy in policies.items():
        chosen = {
            c
            for c, d in deployments.items()
            if selects(policy["spec"]["podSelector"], pod_labels(d))
        }
        assert chosen == {component}, (component, chosen)
    redis_np = policies["redis"]["spec"]
    assert redis_np["policyTypes"] == ["Ingress", "Egress"] and redis_np["egress"] == []
    (rule,) = redis_np["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only
    assert selects(peer["podSelector"], pod_labels(deployments["vllm"]))
    assert not selects(peer["podSelector"], pod_labels(deployments["redis"]))
    # the vLLM pods: only the HTTP port, from the gateway namespace; egress to DNS and Redis
    vllm_np = policies["vllm"]["spec"]
    (rule,) = vllm_np["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert rule["from"] == SCENARIOS["in-chart-redis"][2]["networkPolicy"]["ingressFrom"]
    assert vllm_np["policyTypes"] == ["Ingress", "Egress"]
    dns, to_redis = vllm_np["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    (peer,) = to_redis["to"]
    assert selects(peer["podSelector"], pod_labels(deployments["redis"]))
    assert to_redis["ports"] == [{"port": 6379, "protocol": "TCP"}]


def test_network_policy_defaults_and_egress_rules(helm, tmp_path):
    (np,) = kind(scenario(helm, "default", tmp_path), "NetworkPolicy")
    assert np["spec"]["policyTypes"] == ["Ingress"] and "egress" not in np["spec"]
    assert "from" not in np["spec"]["ingress"][0]  # any source, HTTP port only
    (np,) = kind(scenario(helm, "s3", tmp_path), "NetworkPolicy")
    rules = SCENARIOS["s3"][2]["networkPolicy"]["egress"]["rules"]
    assert np["spec"]["egress"][1:] == rules  # after DNS
    off = {
        "networkPolicy": {"enabled": False},
        "redis": {"enabled": True},
        "kvtier": {"hmac": HMAC},
    }
    assert not kind(render(helm, off, tmp_path), "NetworkPolicy")


# ---------------------------------------------------------------- signing, PDB, NOTES


@pytest.mark.parametrize(
    "tier",
    [
        {"kvtier": {"remoteUrl": "s3://kv/prod"}},
        {"kvtier": {"remoteUrl": "redis://redis.cache:6379/0"}},
        {"kvtier": {"remoteUrl": "file:///mnt/shared/kv"}},
        {"redis": {"enabled": True}},
    ],
    ids=["s3", "redis", "file", "in-chart-redis"],
)
def test_an_object_tier_needs_an_hmac_key_unless_unsigned_is_accepted(helm, tmp_path, tier):
    err = render_fails(helm, tier, tmp_path)
    assert "no HMAC key signs its chunks" in err
    assert "kvtier.hmac.existingSecret" in err and "kvtier.allowUnsignedChunks=true" in err
    signed = json.loads(json.dumps(tier))
    signed.setdefault("kvtier", {})["hmac"] = HMAC
    render(helm, signed, tmp_path)
    unsigned = json.loads(json.dumps(tier))
    unsigned.setdefault("kvtier", {})["allowUnsignedChunks"] = True
    render(helm, unsigned, tmp_path)
    by_file = json.loads(json.dumps(tier))
    by_file.setdefault("kvtier", {})["extraConfig"] = {"hmac_key_file": "/etc/kvtier/hmac/key"}
    render(helm, by_file, tmp_path)


def test_pod_disruption_budget(helm, tmp_path):
    assert not kind(scenario(helm, "default", tmp_path), "PodDisruptionBudget")
    docs = scenario(helm, "in-chart-redis", tmp_path)
    (pdb,) = kind(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    chosen = [
        d["metadata"]["name"]
        for d in kind(docs, "Deployment")
        if selects(pdb["spec"]["selector"], pod_labels(d))
    ]
    assert chosen == ["cache-kvtier"]
    values = {"podDisruptionBudget": {"enabled": True, "maxUnavailable": "", "minAvailable": "50%"}}
    (pdb,) = kind(render(helm, values, tmp_path), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in pdb["spec"]
    both = {"podDisruptionBudget": {"enabled": True, "minAvailable": 1}}
    assert "give minAvailable or maxUnavailable, not both" in render_fails(helm, both, tmp_path)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"securityContext": {"runAsUser": "root"}}, "securityContext.runAsUser: Invalid type"),
        (
            {"redis": {"podSecurityContext": {"runAsNonRoot": "yes"}}},
            "redis.podSecurityContext.runAsNonRoot: Invalid type",
        ),
        (
            {"networkPolicy": {"egress": {"rules": {"to": []}}}},
            "networkPolicy.egress.rules: Invalid type",
        ),
        (
            {"podDisruptionBudget": {"minAvailable": "most"}},
            "podDisruptionBudget.minAvailable: Does not match pattern",
        ),
        ({"redis": {"aclRules": "+@all >sneaky"}}, "redis.aclRules: Does not match pattern"),
        (
            {"writableDirs": {"home": {"path": "relative"}}},
            "writableDirs.home.path: Does not match pattern",
        ),
    ],
)
def test_schema_rejects_bad_security_values(helm, tmp_path, values, message):
    assert message in render_fails(helm, values, tmp_path)


class FakeApiServer:
    """Just enough of a Kubernetes API server for helm: discovery, Secrets to look up,
    and empty lists (no releases, no existing objects)."""

    GROUPS = {
        "": ["Secret", "ConfigMap", "Service", "ServiceAccount"],
        "apps": ["Deployment"],
        "networking.k8s.io": ["NetworkPolicy"],
        "policy": ["PodDisruptionBudget"],
        "monitoring.coreos.com": ["ServiceMonitor", "PodMonitor", "PrometheusRule"],
    }

    def __init__(self, directory: Path) -> None:
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?")[0]
                api.requests.append(path)
                code, body = api.answer(path)
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [
                        {
                            "name": "fake",
                            "cluster": {
                                "server": f"http://127.0.0.1:{self.server.server_address[1]}"
                            },
                        }
                    ],
                    "users": [{"name": "fake", "user": {"token": "fake"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                }
            )
        )
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/version":
            return 200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            return 200, {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                        "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"},
                    }
                    for g in self.GROUPS
                    if g
                ],
            }
        for group, kinds in self.GROUPS.items():
            if path == (f"/apis/{group}/v1" if group else "/api/v1"):
                return 200, {
                    "kind": "APIResourceList",
                    "groupVersion": f"{group}/v1" if group else "v1",
                    "resources": [
                        {
                            "name": k.lower() + "s",
                            "singularName": k.lower(),
                            "namespaced": True,
                            "kind": k,
                            "verbs": ["get", "list", "create"],
                        }
                        for k in kinds
                    ],
                }
        parts = path.strip("/").split("/")
        if len(parts) >= 2 and parts[-2] == "secrets" and parts[-4] == "namespaces":
            if (parts[-3], parts[-1]) in self.secrets:
                return 200, self.secrets[(parts[-3], parts[-1])]
        if parts[-1] == "secrets":
            return 200, {"kind": "SecretList", "apiVersion": "v1", "metadata": {}, "items": []}
        return 404, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "code": 404,
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_api(tmp_path) -> Iterator[FakeApiServer]:
    server = FakeApiServer(tmp_path)
    yield server
    server.close()


def install_notes(helm: str, values: dict[str, Any], tmp: Path, fake_api: FakeApiServer) -> str:
    """NOTES.txt as `helm install` prints it (a dry run against the fake API server)."""
    vfile = tmp / "notes-values.yaml"
    vfile.write_text(yaml.safe_dump(values))
    out = subprocess.run(
        [
            helm,
            "install",
            "rel",
            str(CHART),
            "-n",
            "llm",
            "-f",
            str(vfile),
            "--kubeconfig",
            str(fake_api.kubeconfig),
            "--dry-run=server",
            "--disable-openapi-validation",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "NOTES:" in out.stdout
    return out.stdout.split("NOTES:", 1)[1]


def test_notes_warn_about_unsigned_chunks_and_the_generated_password(helm, tmp_path, fake_api):
    image = {"repository": "registry.example.com/vllm-kvtier"}
    notes = install_notes(
        helm,
        {"image": image, "kvtier": {"remoteUrl": "s3://kv/prod", "hmac": HMAC}},
        tmp_path,
        fake_api,
    )
    assert "WARNING" not in notes
    assert "The root file system is read-only" in notes
    notes = install_notes(
        helm,
        {"redis": {"enabled": True}, "kvtier": {"allowUnsignedChunks": True}},
        tmp_path,
        fake_api,
    )
    assert "WARNING: kvtier.allowUnsignedChunks is true" in notes
    assert "redis://rel-kvtier-redis:6379/0 can feed KV to" in " ".join(notes.split())
    assert "password in Secret rel-kvtier-redis-auth (generated; kept on upgrades)" in notes
    notes = install_notes(
        helm,
        {"redis": {"enabled": True}, "kvtier": {"hmac": HMAC}, "networkPolicy": {"enabled": False}},
        tmp_path,
        fake_api,
    )
    assert "WARNING: networkPolicy.enabled is false" in notes


# ---------------------------------------------------------------- encryption key

ENC_SECRET = "kvtier-encryption-5d2c"
ENC_KEY = "5d2c0b7e" * 8  # 64 hex characters: a 256-bit key


@pytest.fixture
def enc_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    """The encryption key's Secret, as cluster_env resolves secretKeyRefs."""
    monkeypatch.setitem(SECRETS, ENC_SECRET, {"encryption-key": ENC_KEY, "other": ENC_KEY[::-1]})
    return ENC_SECRET


@pytest.mark.parametrize(
    "values",
    [
        {"kvtier": {"remoteUrl": "s3://kv/prod"}},
        {"redis": {"enabled": True, "existingSecret": "kvtier-inchart-redis-4f5a"}},
        {"kvtier": {"remoteUrl": "s3://kv/prod", "hmac": HMAC}},
    ],
    ids=["s3", "in-chart-redis", "with-hmac"],
)
def test_the_encryption_key_comes_from_a_secret(helm, tmp_path, enc_secret, values):
    """kvtier.encryption.existingSecret: a secretKeyRef in the vLLM container's environment,
    encryption_key_env naming it in the config, the key in no manifest; it is enough for an
    object tier on its own (AES-GCM authenticates), and kvtier builds its sealer from it."""
    from kvtier.objects.codec import Signer
    from kvtier.objects.sealing import key_id

    values = json.loads(json.dumps(values))
    values.setdefault("kvtier", {})["encryption"] = {"existingSecret": enc_secret}
    out = helm_template(helm, values, tmp_path)
    assert out.returncode == 0, out.stderr
    assert ENC_KEY not in out.stdout
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (dep,) = kind(docs, "Deployment", "vllm")
    (c,) = pod_spec(dep)["containers"]
    (entry,) = [e for e in c["env"] if e["name"] == "KVTIER_ENCRYPTION_KEY"]
    assert entry["valueFrom"] == {"secretKeyRef": {"name": enc_secret, "key": "encryption-key"}}
    extra = transfer_config(c)["kv_connector_extra_config"]
    assert extra["encryption_key_env"] == "KVTIER_ENCRYPTION_KEY"
    env = cluster_env(c)
    signer = Signer.from_config(load_config(extra, environ=env), env)
    assert signer is not None and signer.sealer is not None
    assert signer.sealer.kid == key_id(bytes.fromhex(ENC_KEY))
    assert signer.hmac == ("hmac" in values["kvtier"])


def test_encryption_secret_key_and_variable_can_be_renamed(helm, tmp_path, enc_secret):
    enc = {"existingSecret": enc_secret, "key": "other", "envName": "SEAL_KEY"}
    docs = render(helm, {"kvtier": {"remoteUrl": "s3://kv/prod", "encryption": enc}}, tmp_path)
    (dep,) = kind(docs, "Deployment", "vllm")
    (c,) = pod_spec(dep)["containers"]
    (entry,) = [e for e in c["env"] if e["name"] == "SEAL_KEY"]
    assert entry["valueFrom"]["secretKeyRef"] == {"name": enc_secret, "key": "other"}
    assert not [e for e in c["env"] if e["name"] == "KVTIER_ENCRYPTION_KEY"]
    assert transfer_config(c)["kv_connector_extra_config"]["encryption_key_env"] == "SEAL_KEY"


def test_without_a_secret_nothing_is_encrypted_and_a_file_key_counts(helm, tmp_path):
    docs = render(helm, {"kvtier": {"remoteUrl": "s3://kv/prod", "hmac": HMAC}}, tmp_path)
    (dep,) = kind(docs, "Deployment", "vllm")
    (c,) = pod_spec(dep)["containers"]
    assert "encryption_key_env" not in transfer_config(c)["kv_connector_extra_config"]
    assert not [e for e in c["env"] if "ENCRYPTION" in e["name"]]
    by_file = {
        "kvtier": {
            "remoteUrl": "s3://kv/prod",
            "extraConfig": {
                "encryption_key_file": "/etc/kvtier/enc/key",
                "encryption_decrypt_keys_file": "/etc/kvtier/enc/old",
            },
        }
    }
    docs = render(helm, by_file, tmp_path)  # no HMAC key needed: the file key authenticates
    (dep,) = kind(docs, "Deployment", "vllm")
    (c,) = pod_spec(dep)["containers"]
    cfg = load_config(transfer_config(c)["kv_connector_extra_config"], environ={})
    assert cfg.encryption_key_file == "/etc/kvtier/enc/key"
    assert cfg.encryption_decrypt_keys_file == "/etc/kvtier/enc/old"
    err = render_fails(helm, {"kvtier": {"remoteUrl": "s3://kv/prod"}}, tmp_path)
    assert "kvtier.encryption.existingSecret" in err


@pytest.mark.parametrize(
    ("encryption", "message"),
    [
        ({"existingSecret": "Not_A_Name"}, "kvtier.encryption.existingSecret: Does not match"),
        ({"envName": "1BAD"}, "kvtier.encryption.envName: Does not match pattern"),
        ({"key": ""}, "kvtier.encryption.key"),
        ({"secret": "x"}, "Additional property secret is not allowed"),
    ],
)
def test_schema_rejects_bad_encryption_values(helm, tmp_path, encryption, message):
    err = render_fails(helm, {"kvtier": {"hmac": HMAC, "encryption": encryption}}, tmp_path)
    assert message in err, err


def test_notes_do_not_warn_when_chunks_are_encrypted(helm, tmp_path, fake_api, enc_secret):
    image = {"repository": "registry.example.com/vllm-kvtier"}
    values = {
        "image": image,
        "kvtier": {"remoteUrl": "s3://kv/prod", "encryption": {"existingSecret": enc_secret}},
    }
    assert "WARNING" not in install_notes(helm, values, tmp_path, fake_api)


# ------------------------------------------- the guards take every spelling vLLM reads
#
# The password guard matched one spelling of each thing: a URL starting its value, and
# --kv-transfer-config exactly. kvtier strips a URL (" redis://u:pw@h" is that tier and
# that password), vLLM reads --kv_transfer_config as --kv-transfer-config, turns a dotted
# --kv-transfer-config.a.b=v into a whole --kv-transfer-config (after the chart's: it
# replaces the connector, its signing and its URL) and takes an unambiguous prefix of a
# flag (--kv-transfer, --kv-t). Each spelling below is rendered by the real helm; the
# spellings are checked against vLLM's own parser (test_the_spellings_are_what_vllm_reads).

PW = "hunter2"
#: --skip-schema-validation: the templates guard themselves (the schema refuses a
#: remoteUrl with a leading space and extraConfig.remote_url; helm can be told to skip it)
NO_SCHEMA = ("--skip-schema-validation",)
UNSIGNED = {"allowUnsignedChunks": True}
KTC_WITH_PW = json.dumps(
    {
        "kv_connector": "KVTierConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"remote_url": f"redis://:{PW}@h/0"},
    }
)
#: arguments that set vLLM's --kv-transfer-config, and the chart must refuse
KTC_SPELLINGS = {
    "underscores": ["--kv_transfer_config", KTC_WITH_PW],
    "underscores=": [f"--kv_transfer_config={KTC_WITH_PW}"],
    "mixed": ["--kv-transfer_config", KTC_WITH_PW],
    "dotted=": [f"--kv-transfer-config.kv_connector_extra_config.remote_url=redis://:{PW}@h/0"],
    "dotted-underscores": [
        "--kv_transfer_config.kv_connector_extra_config.remote_url",
        f"redis://:{PW}@h/0",
    ],
    "dotted-role": ["--kv-transfer-config.kv_role", "kv_both"],
    "prefix": ["--kv-transfer", KTC_WITH_PW],
    "short-prefix=": [f"--kv-t={KTC_WITH_PW}"],
    "prefix-dotted": [f"--kv_transf.kv_connector_extra_config.remote_url=redis://:{PW}@h/0"],
}
#: arguments near those that are other flags: the chart passes them on
NOT_KTC = [
    ["--kv-cache-dtype", "auto"],
    ["--kv_cache_dtype=auto"],
    ["--kv-events-config", '{"enable_kv_cache_events": false}'],
    ["--max-model-len", "2048"],
    ["--served-model-name", "kv-transfer-config"],
]


@pytest.mark.parametrize("where", ["extraArgs", "sizingArgs", "command"])
@pytest.mark.parametrize("name", list(KTC_SPELLINGS))
def test_every_spelling_of_kv_transfer_config_is_refused(helm, tmp_path, name, where):
    args = KTC_SPELLINGS[name]
    vllm = {"command": ["vllm", "serve", *args]} if where == "command" else {where: args}
    err = render_fails(helm, {"kvtier": UNSIGNED, "vllm": vllm}, tmp_path)
    assert "must not hold --kv-transfer-config" in err, err
    assert f"vllm.{where}[" in err and PW not in err, err


@pytest.mark.parametrize("args", NOT_KTC, ids=lambda a: a[0])
def test_other_kv_flags_pass_through(helm, tmp_path, args):
    (dep,) = kind(render(helm, {"vllm": {"extraArgs": args}}, tmp_path), "Deployment")
    (c,) = pod_spec(dep)["containers"]
    assert c["args"][-len(args) :] == args
    assert transfer_config(c)["kv_connector"] == "KVTierConnector"


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM's own `vllm serve` parser (FlexibleArgumentParser), as the container runs it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_the_spellings_are_what_vllm_reads(vllm_parser):
    """Every spelling the chart refuses replaces the chart's --kv-transfer-config in vLLM
    (given after it, as vllm.extraArgs are); every one it passes on leaves it alone."""
    chart = [
        "--model",
        "m",
        "--kv-transfer-config",
        json.dumps(
            {
                "kv_connector": "KVTierConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": "kvtier.connectors.vllm",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"hmac_key_env": "KVTIER_HMAC_KEY"},
            }
        ),
    ]

    def seen(args: list[str]) -> tuple[Any, ...]:
        c = vllm_parser.parse_args(chart + args).kv_transfer_config
        return (
            c.kv_connector,
            c.kv_role,
            c.kv_connector_module_path,
            c.kv_load_failure_policy,
            c.kv_connector_extra_config,
        )

    kept = seen([])
    assert kept[0] == "KVTierConnector"
    for name, args in KTC_SPELLINGS.items():
        assert seen(args) != kept, f"{name}: vLLM kept the chart's config"
    for args in NOT_KTC:
        assert seen(args) == kept, args


@pytest.mark.parametrize(
    ("values", "flags", "message"),
    [
        (
            {"kvtier": {**UNSIGNED, "remoteUrl": f" redis://u:{PW}@h:6379/0"}},
            NO_SCHEMA,
            "kvtier.remoteUrl holds credentials",
        ),
        (
            {"kvtier": {**UNSIGNED, "remoteUrl": f"\t\nredis://u:{PW}@h:6379/0 "}},
            NO_SCHEMA,
            "kvtier.remoteUrl holds credentials",
        ),
        (
            {"kvtier": {**UNSIGNED, "extraConfig": {"remote_url": f" redis://:{PW}@h/0"}}},
            NO_SCHEMA,
            "kvtier.extraConfig.remote_url holds credentials",
        ),
        (
            {
                "kvtier": {
                    **UNSIGNED,
                    "remoteUrl": "s3://b/p",
                    "s3": {"endpointUrl": f" https://AKIA:{PW}@s3:9000"},
                }
            },
            NO_SCHEMA,
            "kvtier.s3.endpointUrl holds credentials",
        ),
        (
            {
                "kvtier": UNSIGNED,
                "vllm": {"env": [{"name": "KVTIER_REMOTE_URL", "value": f" redis://u:{PW}@h/0"}]},
            },
            (),
            "vllm.env KVTIER_REMOTE_URL holds credentials",
        ),
        (
            {
                "kvtier": UNSIGNED,  # a JSON value with its slashes escaped
                "vllm": {"env": [{"name": "CFG", "value": f'{{"u": "redis:\\/\\/:{PW}@h"}}'}]},
            },
            (),
            "vllm.env CFG holds credentials",
        ),
        (
            {"vllm": {"extraArgs": ["--otlp-traces-endpoint", f" https://u:{PW}@otel:4317"]}},
            (),
            "vllm.extraArgs[1] holds credentials",
        ),
        (
            {"vllm": {"extraArgs": ["--x-config", f'{{"url": "redis://u:{PW}@h"}}']}},
            (),
            "vllm.extraArgs[1] holds credentials",
        ),
        (
            {"vllm": {"command": ["env", f"OTEL=https://u:{PW}@otel", "vllm", "serve"]}},
            (),
            "vllm.command[1] holds credentials",
        ),
    ],
    ids=[
        "remoteUrl-space",
        "remoteUrl-tab",
        "extraConfig-space",
        "s3-endpoint-space",
        "env-space",
        "env-json-escaped",
        "arg-space",
        "arg-json",
        "command",
    ],
)
def test_a_password_is_refused_wherever_kvtier_would_find_it(
    helm, tmp_path, values, flags, message
):
    err = render_fails(helm, values, tmp_path, flags)
    assert message in err, err
    assert PW not in err, "the message repeats the secret"


def test_a_url_with_spaces_is_the_tier_kvtier_uses(helm, tmp_path):
    """kvtier strips remote_url: so does the chart, so the tier, its redis:// checks and the
    password it adds from the Secret are the ones kvtier will use."""
    values = {
        "kvtier": {
            "hmac": HMAC,
            "remoteUrl": "  redis://redis.cache:6379/0 ",
            "redis": {"existingSecret": "redis-auth"},
        }
    }
    (dep,) = kind(render(helm, values, tmp_path, flags=NO_SCHEMA), "Deployment")
    (c,) = pod_spec(dep)["containers"]
    assert (
        transfer_config(c)["kv_connector_extra_config"]["remote_url"]
        == "redis://redis.cache:6379/0"
    )
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVTIER_REMOTE_URL"] == "redis://:$(REDIS_PASSWORD)@redis.cache:6379/0"


@pytest.mark.parametrize(
    "key", ["remote_url", "s3_endpoint_url", "hmac_key_env", "encryption_key_env", "namespace"]
)
def test_settings_the_chart_owns_are_refused_in_extra_config(helm, tmp_path, key):
    """Even when the chart leaves one unset: extraConfig.remote_url with kvtier.remoteUrl
    empty was an object tier that the signing check never saw."""
    values = {"kvtier": {"extraConfig": {key: "redis://redis.cache:6379/0"}}}
    err = render_fails(helm, values, tmp_path, NO_SCHEMA)
    assert f"kvtier.extraConfig.{key}: the chart sets {key}" in err, err


def test_an_object_tier_from_the_environment_needs_a_key_too(helm, tmp_path):
    """KVTIER_REMOTE_URL in vllm.env overrides remote_url: it is an object tier, signed
    only if a key is set (the chart's, or a KVTIER_* key override beside it)."""
    env = [
        {"name": "KVTIER_REMOTE_URL", "valueFrom": {"secretKeyRef": {"name": "tier", "key": "url"}}}
    ]
    err = render_fails(helm, {"vllm": {"env": env}}, tmp_path)
    assert "KVTIER_REMOTE_URL in vllm.env" in err and "no HMAC key signs its chunks" in err
    render(helm, {"vllm": {"env": env}, "kvtier": {"hmac": HMAC}}, tmp_path)
    render(helm, {"vllm": {"env": env}, "kvtier": UNSIGNED}, tmp_path)
    keyed = [*env, {"name": "KVTIER_HMAC_KEY_FILE", "value": "/etc/kvtier/hmac/key"}]
    render(helm, {"vllm": {"env": keyed}}, tmp_path)


def test_flags_the_chart_reads_are_read_in_vllms_spelling(helm, tmp_path):
    """The chart reads --tensor-parallel-size, --shutdown-timeout and --cpu-offload-gb from
    the args as vLLM does, underscores included: --tensor_parallel_size 2 is two workers."""
    err = render_fails(
        helm,
        {"gpu": {"count": 1}, "vllm": {"extraArgs": ["--tensor_parallel_size", "2"]}},
        tmp_path,
    )
    assert "run 2 GPU workers" in err and "gpu.count is 1" in err, err
    err = render_fails(
        helm,
        {"weightOffload": {"cpuOffloadGb": 2}, "vllm": {"extraArgs": ["--cpu_offload_gb=2"]}},
        tmp_path,
    )
    assert "--cpu-offload-gb is set twice" in err, err
    values = {
        "kvtier": {**UNSIGNED, "remoteUrl": "s3://b/p"},
        "vllm": {"extraArgs": ["--shutdown_timeout=45"]},
    }
    (dep,) = kind(render(helm, values, tmp_path), "Deployment")
    (c,) = pod_spec(dep)["containers"]
    assert not [a for a in c["args"] if a.startswith("--shutdown-timeout")]
    err = render_fails(helm, {**values, "terminationGracePeriodSeconds": 50}, tmp_path)
    assert "--shutdown-timeout 45" in err, err
