"""The chart's ``kvtier.gc`` CronJob, rendered by the real helm: the engines' image,
config, secrets and security contexts; its NetworkPolicies; the values schema; checkov and
the Kubernetes API schemas; and the rendered job itself run (its command, its config
file, its environment with the secrets filled in as the kubelet would) against a real
S3 (moto) and a real redis-server with a password, deleting the dead generation only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from store_kit import NS, NS_B, write_engine
from test_helm import find_helm
from test_helm_security import (
    ALLOWED_SKIPS,
    KUBERNETES_VERSIONS,
    helm_template,
    render,
    render_fails,
    tool,
)

from kvtier.objects.manifest import manifest_key

pytestmark = pytest.mark.integration

HMAC_SECRET = {"kvtier-hmac": {"hmac-key": "h" * 64}}
GC = {"enabled": True, "deadAfter": "3d", "maxBytes": "500Gi", "schedule": "*/30 * * * *"}
QUOTAS = {"chat": "400GiB", "crawl": "100Gi", "*": 20 * 2**30}
S3_TIER = {
    "remoteUrl": "s3://kv-cache/prod",
    "s3": {"endpointUrl": "https://s3.internal:9000", "existingSecret": "s3-keys"},
    "hmac": {"existingSecret": "kvtier-hmac"},
    "encryption": {"existingSecret": "kvtier-encryption"},
}


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def job_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cron,) = of_kind(docs, "CronJob")
    spec: dict[str, Any] = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return spec


def test_gc_is_off_by_default(helm, tmp_path) -> None:
    docs = render(helm, {"kvtier": S3_TIER}, tmp_path)
    assert of_kind(docs, "CronJob") == []
    assert not [d for d in docs if d["metadata"]["name"].endswith("-gc")]


def test_the_job_runs_kvtier_store_gc_as_the_engines_run(helm, tmp_path) -> None:
    docs = render(helm, {"kvtier": {**S3_TIER, "gc": GC}}, tmp_path)
    (cron,) = of_kind(docs, "CronJob")
    assert cron["spec"]["schedule"] == "*/30 * * * *"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = job_pod(docs)
    (dep,) = [
        d
        for d in of_kind(docs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "vllm"
    ]
    vpod = dep["spec"]["template"]["spec"]
    (vllm,) = vpod["containers"]
    (gc,) = pod["containers"]
    assert gc["command"] == ["kvtier"]
    assert gc["args"] == [
        "store",
        "gc",
        "--config",
        "/etc/kvtier/gc/config.json",
        "--dead-after",
        "3d",
        "--max-bytes",
        str(500 * 2**30),
    ]
    assert gc["image"] == vllm["image"] and gc["imagePullPolicy"] == vllm["imagePullPolicy"]
    assert gc["securityContext"] == vllm["securityContext"]
    assert pod["securityContext"] == vpod["securityContext"]
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["restartPolicy"] == "Never"
    # the engines' secrets, by reference only
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gc["env"] if "valueFrom" in e}
    vrefs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in vllm["env"] if "valueFrom" in e}
    assert refs == vrefs and {
        "AWS_ACCESS_KEY_ID",
        "KVTIER_HMAC_KEY",
        "KVTIER_ENCRYPTION_KEY",
    } <= set(refs)
    # the engines' kv_connector_extra_config, which holds no secret
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-gc")]
    config = json.loads(cm["data"]["config.json"])
    transfer = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert config == transfer["kv_connector_extra_config"]
    mounts = {m["mountPath"]: m for m in gc["volumeMounts"]}
    assert mounts["/etc/kvtier/gc"]["readOnly"] is True
    # its pods are not the engines': no Service, PDB or monitor selects them
    labels = cron["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    for svc in of_kind(docs, "Service"):
        assert not svc["spec"]["selector"].items() <= labels.items()


def test_tenant_quotas_reach_the_job_as_a_file_kvtier_reads(helm, tmp_path) -> None:
    from kvtier.cli.store import read_tenant_quotas

    docs = render(helm, {"kvtier": {**S3_TIER, "gc": {**GC, "tenantQuotas": QUOTAS}}}, tmp_path)
    (gc,) = job_pod(docs)["containers"]
    assert gc["args"][-4:] == [
        "--max-bytes",
        str(500 * 2**30),
        "--tenant-quotas",
        "/etc/kvtier/gc/tenant-quotas.json",
    ]
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-gc")]
    path = tmp_path / "tenant-quotas.json"
    path.write_text(cm["data"]["tenant-quotas.json"])
    assert read_tenant_quotas(str(path)) == {
        "chat": 400 * 2**30,
        "crawl": 100 * 2**30,
        "*": 20 * 2**30,
    }
    # none given: neither the file nor the flag
    docs = render(helm, {"kvtier": {**S3_TIER, "gc": {**GC, "tenantQuotas": {}}}}, tmp_path)
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-gc")]
    (gc,) = job_pod(docs)["containers"]
    assert list(cm["data"]) == ["config.json"] and "--tenant-quotas" not in gc["args"]


def test_the_rendered_job_trims_a_tenant_over_its_quota(helm, tmp_path) -> None:
    """team-a: 4 chunks, team-b: 2, one chunk no one's, on a directory tier whose manifest
    attributes them as rank 0's writer does; a quota of 2 chunks for team-a: the job
    deletes team-a's 2 oldest, nothing else."""
    from kit import collect, payload
    from store_kit import DT, SHAPE, file_objects

    from kvtier.config import load_config
    from kvtier.keys import KeySpace
    from kvtier.objects.manifest import ManifestWriter
    from kvtier.objects.remote import RemoteIO
    from kvtier.objects.tenant_keys import TenantKeys

    root = tmp_path / "kv"
    root.mkdir()
    url = f"file://{root}"
    rio = RemoteIO.from_config(load_config({"remote_url": url}, environ={}), environ={})
    space = KeySpace.worker(NS, 0, 0)
    owned: dict[str, list[str]] = {"team-a": [], "team-b": [], "none": []}
    order = ["none", "team-a", "team-b", "team-a", "team-a", "team-b", "team-a"]
    for i, who in enumerate(order):
        key = space.key(os.urandom(16))
        assert rio.submit_put(i + 1, key, payload(i), dtype=DT, shape=SHAPE)
        owned[who].append(key)
    assert rio.flush(10.0) == 0 and all(r.ok for r in collect(rio, len(order)).values())
    now = time.time()
    for i, who in enumerate(order):  # each older than the next
        key = owned[who][order[:i].count(who)]
        os.utime(rio.tier.path(key), (now - 1000 + 100 * i,) * 2)  # type: ignore[attr-defined]
    writer = ManifestWriter(rio.tier, None, lambda: NS)
    writer.add_tenants(TenantKeys.of({t: owned[t] for t in ("team-a", "team-b")}))
    assert writer.refresh() is not None
    rio.close()
    before = file_objects(root)
    quota = 2 * max(before[k] for k in owned["team-a"])
    gc = {**GC, "maxBytes": "", "tenantQuotas": {"team-a": quota}}
    values = {"kvtier": {"remoteUrl": url, "allowUnsignedChunks": True, "gc": gc}}
    out = run_rendered_job(render(helm, values, tmp_path), {}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "of tenant team-a: over its quota" in out.stdout, out.stdout
    assert set(file_objects(root)) == set(before) - set(owned["team-a"][:2]), out.stdout


def test_network_policies_let_the_job_reach_the_in_chart_redis_only_outbound(
    helm, tmp_path
) -> None:
    values = {
        "redis": {"enabled": True},
        "kvtier": {"hmac": {"existingSecret": "kvtier-hmac"}, "gc": GC},
        "networkPolicy": {"egress": {"restrict": True}},
    }
    docs = render(helm, values, tmp_path)
    pols = {d["metadata"]["name"]: d["spec"] for d in of_kind(docs, "NetworkPolicy")}
    labels = {k: v for k, v in job_pod_labels(docs).items()}
    mine = [p for p in pols.values() if p["podSelector"]["matchLabels"].items() <= labels.items()]
    assert len(mine) == 1 and mine[0]["ingress"] == [], "the gc pods take no connection"
    assert any(r.get("ports") == [{"port": 6379, "protocol": "TCP"}] for r in mine[0]["egress"])
    admits = [
        p
        for p in pols.values()
        if p["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "redis"
        and any(
            f.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
            for r in p.get("ingress", [])
            for f in r.get("from", [])
        )
    ]
    assert len(admits) == 1, "the in-chart Redis does not admit the gc pods"


def job_pod_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    (cron,) = of_kind(docs, "CronJob")
    labels: dict[str, str] = cron["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    return labels


@pytest.mark.parametrize(
    ("gc", "says"),
    [
        ({"deadAfter": "soon"}, "deadAfter"),
        ({"maxBytes": "lots"}, "maxBytes"),
        ({"maxBytes": -1}, "maxBytes"),
        ({"schedule": ""}, "schedule"),
        ({"typo": 1}, "typo"),
        ({"tenantQuotas": {"team a": "1GiB"}}, "tenantQuotas"),
        ({"tenantQuotas": {"team-a": "lots"}}, "tenantQuotas"),
        ({"tenantQuotas": {"team-a": 0}}, "tenantQuotas"),
        ({"tenantQuotas": {"team-a": "0GiB"}}, "greater than zero"),
        ({"tenantQuotas": {"untagged": "1GiB"}}, "never a tenant's name"),
    ],
)
def test_the_schema_refuses_nonsense(helm, tmp_path, gc, says) -> None:
    err = render_fails(helm, {"kvtier": {**S3_TIER, "gc": {**GC, **gc}}}, tmp_path)
    assert says in err, err


def test_gc_needs_an_object_tier(helm, tmp_path) -> None:
    err = render_fails(helm, {"kvtier": {"gc": GC}}, tmp_path)
    assert "kvtier.gc.enabled needs an object tier" in err


def _rendered_files(helm: str, tmp: Path) -> list[Path]:
    files = []
    for name, values in {
        "s3": {"kvtier": {**S3_TIER, "gc": {**GC, "tenantQuotas": QUOTAS}}},
        "redis": {
            "redis": {"enabled": True, "tls": {"enabled": True, "existingSecret": "redis-tls"}},
            "kvtier": {"hmac": {"existingSecret": "kvtier-hmac"}, "gc": GC},
            "networkPolicy": {"egress": {"restrict": True}},
        },
        "pinned": {
            "image": {"digest": "sha256:" + "ab" * 32},
            "kvtier": {
                "remoteUrl": "redis://r:6379/0",
                "allowUnsignedChunks": True,
                "gc": {
                    **GC,
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "256Mi"},
                        "limits": {"cpu": "1", "memory": "1Gi"},
                    },
                },
            },
        },
    }.items():
        out = helm_template(helm, values, tmp, release=f"gc-{name}", namespace=f"gc-{name}")
        assert out.returncode == 0, out.stderr
        path = tmp / f"{name}.yaml"
        path.write_text(out.stdout)
        files.append(path)
    return files


def test_checkov_passes_the_job(helm, tmp_path) -> None:
    out_dir = tmp_path / "rendered"
    out_dir.mkdir()
    _rendered_files(helm, out_dir)
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
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode in (0, 1), out.stderr
    results = json.loads(out.stdout)["results"]
    failed = [f"{c['check_id']} {c['resource']}" for c in results.get("failed_checks", [])]
    assert failed == [], failed
    ran = {(c["check_id"], c["resource"]) for c in results.get("passed_checks", [])}
    for ns in ("gc-s3", "gc-redis", "gc-pinned"):
        job = f"CronJob.{ns}.{ns}-kvtier-gc"
        assert ("CKV_K8S_20", job) in ran and ("CKV_K8S_22", job) in ran, "the job was not checked"
    for c in results.get("skipped_checks", []):
        assert c["check_id"] in ALLOWED_SKIPS, c["check_id"]
        assert len(c["check_result"].get("suppress_comment", "")) > 40
    # with a digest and a CPU limit nothing is skipped on the job
    assert not [
        c
        for c in results.get("skipped_checks", [])
        if c["resource"] == "CronJob.gc-pinned.gc-pinned-kvtier-gc"
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_job_validates_against_the_kubernetes_api(helm, tmp_path, version) -> None:
    files = _rendered_files(helm, tmp_path)
    out = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", version, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    assert re.search(r"passed for resource cronjob/gc-s3-kvtier-gc", report), report


# -- the rendered job, run ----------------------------------------------------------------


def _kube_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's env values and args."""
    return re.sub(
        r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text
    )


def run_rendered_job(
    docs: list[dict[str, Any]], secrets: dict[str, dict[str, str]], tmp: Path
) -> subprocess.CompletedProcess:
    """The CronJob's container as the kubelet starts it: its env (secrets filled in, then
    $(VAR) expanded in order), its ConfigMap at its mount path, its command and args."""
    (gc,) = job_pod(docs)["containers"]
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-gc")]
    env: dict[str, str] = {}
    for e in gc["env"]:
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            env[e["name"]] = _kube_expand(str(e["value"]), env)
    for name, text in cm["data"].items():  # config.json, tenant-quotas.json
        (tmp / name).write_text(text)
    args = [_kube_expand(a, env).replace("/etc/kvtier/gc/", f"{tmp}/") for a in gc["args"]]
    assert gc["command"] == ["kvtier"]
    env["HOME"] = str(tmp)
    env["PATH"] = os.environ.get("PATH", "")
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_rendered_job_deletes_the_dead_generation_on_s3(helm, tmp_path, s3_bucket) -> None:
    hmac_env = {"KVTIER_HMAC_KEY": "h" * 64}
    extra = {
        "remote_url": s3_bucket.url,
        "s3_endpoint_url": s3_bucket.endpoint_url,
        "hmac_key_env": "KVTIER_HMAC_KEY",
    }
    dead = write_engine(extra, NS, seed=1, clock=lambda: time.time() - 10 * 86400, environ=hmac_env)
    live = write_engine(extra, NS_B, seed=2, environ=hmac_env)
    values = {
        "kvtier": {
            "remoteUrl": s3_bucket.url,
            "s3": {
                "endpointUrl": s3_bucket.endpoint_url,
                "region": "us-east-1",
                "existingSecret": "s3-keys",
            },
            "hmac": {"existingSecret": "kvtier-hmac"},
            "gc": GC,
        }
    }
    docs = render(helm, values, tmp_path)
    secrets = {
        "s3-keys": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
        **HMAC_SECRET,
    }
    out = run_rendered_job(docs, secrets, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "deleted 8 chunks" in out.stdout and dead.generation in out.stdout, out.stdout
    client = s3_bucket.server.client()
    held = {
        o["Key"].removeprefix("kv/")
        for o in client.list_objects_v2(Bucket=s3_bucket.name).get("Contents", [])
    }
    assert held == {*live.keys, manifest_key(live.generation)}


def test_the_rendered_job_reaches_a_redis_with_its_password(helm, tmp_path, services) -> None:
    server = services.redis(password="pw-3f9a1c")
    hmac_env = {"KVTIER_HMAC_KEY": "h" * 64}
    extra = {"remote_url": server.url, "hmac_key_env": "KVTIER_HMAC_KEY"}
    dead = write_engine(extra, NS, seed=3, clock=lambda: time.time() - 10 * 86400, environ=hmac_env)
    live = write_engine(extra, NS_B, seed=4, environ=hmac_env)
    values = {
        "kvtier": {
            "remoteUrl": f"redis://{server.host}:{server.port}/0",
            "redis": {"existingSecret": "redis-auth"},
            "hmac": {"existingSecret": "kvtier-hmac"},
            "gc": {**GC, "maxBytes": ""},
        }
    }
    docs = render(helm, values, tmp_path)
    (gc,) = job_pod(docs)["containers"]
    assert "pw-3f9a1c" not in yaml.safe_dump(docs) and "--max-bytes" not in gc["args"]
    secrets = {"redis-auth": {"redis-password": "pw-3f9a1c"}, **HMAC_SECRET}
    out = run_rendered_job(docs, secrets, tmp_path)
    assert out.returncode == 0, out.stderr
    assert dead.generation in out.stdout
    with server.client() as r:
        held = {k.decode() for k in r.scan_iter()}
    assert held == {*live.keys, manifest_key(live.generation)}
