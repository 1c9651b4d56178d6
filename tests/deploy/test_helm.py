"""The Helm chart in deploy/helm/kvtier, rendered by a real helm v3 binary.

Every value set is linted and templated; the rendered manifests are parsed and
checked against kvtier itself: the --kv-transfer-config argument goes through
kvtier.config.load_config, the memory request/limit through the planner's
host_total_bytes, and credentials must arrive only as secretKeyRef.

helm comes from PATH or the repository's .tools/helm (.ci/run fetches it with
deploy/tools/fetch-helm.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import KEYS, load_config, parse_size
from kvtier.sizing.autosize import weight_offload_host_bytes
from kvtier.sizing.memory_plan import host_total_bytes, parse_k8s_quantity

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvtier"
MODELS = ROOT / "tests" / "fixtures" / "models"
GiB = 2**30

# Secret names and the values the (simulated) cluster holds for them. The values
# are distinctive so that a leak into a manifest is easy to spot; helm never sees them.
SECRETS = {
    "kvtier-s3-creds-7c1e": {
        "AWS_ACCESS_KEY_ID": "AKIAFAKE7C1EACCESS",
        "AWS_SECRET_ACCESS_KEY": "fake-s3-secret-7c1e-do-not-inline",
    },
    "kvtier-redis-auth-9b2d": {"redis-password": "fakeRedisPw9b2dNoInline"},
    "kvtier-inchart-redis-4f5a": {"redis-password": "fakeInChartPw4f5aNoInline"},
    "kvtier-hmac-3a8f": {"hmac-key": "fake-hmac-key-3a8f-do-not-inline"},
}
SECRET_VALUES = [v for keys in SECRETS.values() for v in keys.values()]

S3 = {
    "remoteUrl": "s3://kv-cache-bucket/prod",
    "s3": {
        "endpointUrl": "http://minio.storage:9000",
        "region": "eu-west-1",
        "existingSecret": "kvtier-s3-creds-7c1e",
    },
    "hmac": {"existingSecret": "kvtier-hmac-3a8f"},
}

# name -> values; each is linted, rendered and checked by every parametrized test
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "s3-tier": {
        "kvtier": {**S3, "cpuBytes": "64GiB", "namespace": "team-a"},
        "resources": {"requests": {"memory": "72Gi"}, "limits": {"memory": "72Gi"}},
    },
    "redis-tier": {
        "kvtier": {
            "remoteUrl": "redis://redis-master.cache.svc:6379/0",
            "redis": {"existingSecret": "kvtier-redis-auth-9b2d", "username": "kvtier"},
            "hmac": {"existingSecret": "kvtier-hmac-3a8f"},
            "cpuBytes": 32 * GiB,
            "writePolicy": "write_back",
            "extraConfig": {"remote_ttl_s": 86400, "io_threads": "auto"},
        },
        "resources": {"limits": {"memory": "40Gi"}, "requests": {"memory": "40Gi"}},
    },
    "in-chart-redis": {
        "redis": {"enabled": True, "existingSecret": "kvtier-inchart-redis-4f5a"},
        "kvtier": {"cpuBytes": "16Gi", "hmac": {"existingSecret": "kvtier-hmac-3a8f"}},
        "resources": {"limits": {"memory": "24Gi"}, "requests": {"memory": "24Gi"}},
    },
    "monitoring-on": {
        "kvtier": {
            "remoteUrl": "s3://kv-cache-bucket/mon",
            "hmac": {"existingSecret": "kvtier-hmac-3a8f"},
        },
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "podMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "grafanaDashboard": {"enabled": True},
        },
    },
    "monitoring-off": {
        "monitoring": {
            "serviceMonitor": {"enabled": False},
            "podMonitor": {"enabled": False},
            "prometheusRule": {"enabled": False},
            "grafanaDashboard": {"enabled": False},
        },
    },
    "replicas": {
        "replicaCount": 4,
        "kvtier": {**S3, "cpuBytes": "48GiB", "extraConfig": {"io_threads": 8}},
        "resources": {"requests": {"memory": "60Gi"}, "limits": {"memory": "60Gi"}},
    },
    "auto-tier-offload-tp2": {
        "gpu": {"count": 2},
        "weightOffload": {"cpuOffloadGb": 5},
        "kvtier": {"cpuBytes": "auto", "headroom": "8GiB"},
        "resources": {"requests": {"memory": "128Gi"}, "limits": {"memory": "128Gi"}},
    },
    "pvc-api-server-tp-args": {
        "model": {"pvc": {"claimName": "models-pvc", "path": "llama3-8b"}, "name": "llama3"},
        "vllm": {
            "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
            "extraArgs": [
                "--tensor-parallel-size=2",
                "--cpu-offload-gb",
                "1.5",
                "--max-model-len",
                "8192",
            ],
        },
        "weightOffload": {"hostBytes": "1700MiB"},
        "kvtier": {"cpuBytes": 20 * 10**9, "chunkSize": 512},
        "resources": {"requests": {"memory": "50Gi"}, "limits": {"memory": "50Gi"}},
    },
}


# ---------------------------------------------------------------- helpers


def find_helm() -> str:
    """A helm v3 binary from PATH or .tools/helm; fails the test when there is none."""
    found = shutil.which("helm")
    local = ROOT / ".tools" / "helm"
    if not found and os.access(local, os.X_OK):
        found = str(local)
    if not found:
        pytest.fail(
            "no helm v3 binary: put one on PATH or run `bash deploy/tools/fetch-helm.sh .tools` "
            "(.ci/run does this)"
        )
    out = subprocess.run([found, "version", "--short"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("v3."), f"{found} is not helm v3: {out.stdout!r}"
    return found


@pytest.fixture(scope="session")
def helm() -> str:
    return find_helm()


_CACHE: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def run_helm(helm: str, cmd: str, values: dict[str, Any], tmp_path: Path, *extra: str):
    """helm lint/template on the chart with these values; identical calls run once."""
    key = (cmd, json.dumps(values, sort_keys=True), *extra)
    if key not in _CACHE:
        vfile = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
        vfile.write_text(yaml.safe_dump(values))
        args = [helm, cmd]
        if cmd == "template":
            args += ["rel"]
        args += [str(CHART), "-f", str(vfile), "--namespace", "llm", *extra]
        _CACHE[key] = subprocess.run(args, capture_output=True, text=True, timeout=60)
    return _CACHE[key]


def render(helm: str, values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    out = run_helm(helm, "template", values, tmp_path)
    assert out.returncode == 0, out.stderr
    # a symlink in the chart makes every render print a notice (issue 62)
    assert "symbolic link" not in out.stderr, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_fails(helm: str, values: dict[str, Any], tmp_path: Path) -> str:
    out = run_helm(helm, "template", values, tmp_path)
    assert out.returncode != 0, f"helm template accepted {values}"
    return out.stderr


def find(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> list[dict]:
    return [
        d
        for d in docs
        if d["kind"] == kind
        and (
            component is None
            or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
            or d.get("spec", {})
            .get("selector", {})
            .get("matchLabels", {})
            .get("app.kubernetes.io/component")
            == component
        )
    ]


def vllm_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = find(docs, "Deployment", "vllm")
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    return c


def transfer_config(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    assert args.count("--kv-transfer-config") == 1
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def cluster_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment Kubernetes would give the container: secretKeyRef resolved
    from SECRETS, then $(VAR) references expanded from earlier entries."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = SECRETS[ref["name"]][ref["key"]]
        else:
            # an undefined $(VAR) stays as it is, as Kubernetes leaves it
            env[e["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                e["value"],
            )
    return env


def size(value: int | str) -> int:
    """kvtier's parse_size, plus the Kubernetes spellings Ki/Mi/Gi/Ti the chart also takes."""
    if isinstance(value, str) and value.strip()[-2:] in ("Ki", "Mi", "Gi", "Ti"):
        value = value.strip() + "B"
    return parse_size("size", value)


def arg_value(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n:
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def expected_host_total(values: dict[str, Any], container: dict[str, Any]) -> tuple[int, int]:
    """(planner's host total, tier-independent part) for the values, from kvtier's own code."""
    kv = values.get("kvtier", {})
    args = container["args"]
    workers = int(arg_value(args, "--tensor-parallel-size", "-tp") or 1)
    workers *= int(arg_value(args, "--pipeline-parallel-size", "-pp") or 1)
    gb = float(arg_value(args, "--cpu-offload-gb") or 0)
    host_bytes = values.get("weightOffload", {}).get("hostBytes")
    if gb and host_bytes:
        offload = size(host_bytes)
    else:
        # the planner's own estimate when the model's tensors are not at hand
        offload, _ = weight_offload_host_bytes(gb, pin=True)
    headroom = size(kv.get("headroom", "4GiB"))
    cpu = kv.get("cpuBytes", "auto")
    tier = 0 if cpu == "auto" else size(cpu)
    fixed = host_total_bytes(
        0, weight_offload_host_bytes=offload, headroom_bytes=headroom, tp=workers
    )
    return host_total_bytes(
        tier, weight_offload_host_bytes=offload, headroom_bytes=headroom, tp=workers
    ), fixed


# ---------------------------------------------------------------- every value set


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint(helm, tmp_path, name):
    out = run_helm(helm, "lint", VALUE_SETS[name], tmp_path, "--strict")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout
    # helm lint reports a template `fail` only as [INFO]; none may appear for good values
    assert "Fail:" not in out.stdout + out.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_kv_transfer_config_is_accepted_by_kvtier(helm, tmp_path, name):
    values = VALUE_SETS[name]
    c = vllm_container(render(helm, values, tmp_path))
    ktc = transfer_config(c)
    assert ktc["kv_connector"] == "KVTierConnector"
    assert ktc["kv_connector_module_path"] == "kvtier.connectors.vllm"
    assert ktc["kv_role"] == "kv_both"
    assert ktc["kv_load_failure_policy"] == "recompute"
    extra = ktc["kv_connector_extra_config"]
    cfg = load_config(extra, environ={})  # the JSON alone
    kv = values.get("kvtier", {})
    want_cpu = kv.get("cpuBytes", "auto")
    assert cfg.cpu_bytes == (want_cpu if want_cpu == "auto" else size(want_cpu))
    assert cfg.chunk_size == kv.get("chunkSize", 256)
    assert cfg.write_policy == kv.get("writePolicy", "write_through")
    assert cfg.namespace == kv.get("namespace", "")
    assert cfg.cpu_headroom_bytes == size(kv.get("headroom", "4GiB"))
    for key, value in kv.get("extraConfig", {}).items():
        assert getattr(cfg, key) == value
    # ... and with the environment the cluster builds (KVTIER_* overrides, secrets)
    env = cluster_env(c)
    cfg = load_config(extra, environ=env)
    if kv.get("hmac", {}).get("existingSecret"):
        assert cfg.hmac_key_env and env[cfg.hmac_key_env] == "fake-hmac-key-3a8f-do-not-inline"
    if kv.get("s3"):
        assert cfg.s3_endpoint_url == kv["s3"]["endpointUrl"]
        assert env["AWS_SECRET_ACCESS_KEY"] == "fake-s3-secret-7c1e-do-not-inline"
    if values.get("redis", {}).get("enabled"):
        assert cfg.remote_url == "redis://:fakeInChartPw4f5aNoInline@rel-kvtier-redis:6379/0"
    elif kv.get("redis", {}).get("existingSecret"):
        assert cfg.remote_url == (
            "redis://kvtier:fakeRedisPw9b2dNoInline@redis-master.cache.svc:6379/0"
        )
    else:
        assert cfg.remote_url == (kv.get("remoteUrl") or None)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_credentials_only_by_secret_reference(helm, tmp_path, name):
    out = run_helm(helm, "template", VALUE_SETS[name], tmp_path)
    assert out.returncode == 0, out.stderr
    for value in SECRET_VALUES:
        assert value not in out.stdout
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert not find(docs, "Secret"), "the chart must not create Secrets"
    secret_like = re.compile(r"SECRET|PASSWORD|ACCESS_KEY|HMAC|TOKEN", re.IGNORECASE)
    for dep in find(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env") or []:
                if secret_like.search(e["name"]) and e["name"] != "KVTIER_REMOTE_URL":
                    ref = e["valueFrom"]["secretKeyRef"]
                    assert ref["name"] in SECRETS and ref["key"] in SECRETS[ref["name"]]
                if "value" in e:
                    # a plain value may only point at other variables, never hold a credential
                    assert "@" not in e["value"] or "$(REDIS_PASSWORD)@" in e["value"], e
            for a in c.get("args") or []:
                assert not re.search(r"://[^/\s\"]*@", a), f"credentials in an argument: {a}"
    extra = transfer_config(vllm_container(docs))["kv_connector_extra_config"]
    assert "@" not in extra.get("remote_url", "")


def test_expected_secret_references(helm, tmp_path):
    c = vllm_container(render(helm, VALUE_SETS["redis-tier"], tmp_path))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert refs["REDIS_PASSWORD"] == {"name": "kvtier-redis-auth-9b2d", "key": "redis-password"}
    assert refs["KVTIER_HMAC_KEY"] == {"name": "kvtier-hmac-3a8f", "key": "hmac-key"}
    plain = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert plain["KVTIER_REMOTE_URL"] == (
        "redis://kvtier:$(REDIS_PASSWORD)@redis-master.cache.svc:6379/0"
    )
    # Kubernetes expands $(VAR) only from variables defined earlier in the list
    names = [e["name"] for e in c["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("KVTIER_REMOTE_URL")
    c = vllm_container(render(helm, VALUE_SETS["s3-tier"], tmp_path))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "kvtier-s3-creds-7c1e", "key": "AWS_ACCESS_KEY_ID"}
    assert refs["AWS_SECRET_ACCESS_KEY"] == {
        "name": "kvtier-s3-creds-7c1e",
        "key": "AWS_SECRET_ACCESS_KEY",
    }


def test_inline_credentials_in_remote_url_are_refused(helm, tmp_path):
    err = render_fails(helm, {"kvtier": {"remoteUrl": "redis://:hunter2@redis:6379/0"}}, tmp_path)
    assert "kvtier.remoteUrl holds credentials" in err


@pytest.mark.parametrize("name", VALUE_SETS)
def test_memory_covers_the_planner_total(helm, tmp_path, name):
    values = VALUE_SETS[name]
    c = vllm_container(render(helm, values, tmp_path))
    total, fixed = expected_host_total(values, c)
    for kind in ("limits", "requests"):
        have = parse_k8s_quantity(c["resources"][kind]["memory"])
        if values.get("kvtier", {}).get("cpuBytes", "auto") == "auto":
            assert have > fixed, (kind, have, fixed)
        else:
            assert have >= total, (kind, have, total)


# ---------------------------------------------------------------- the memory check


def test_limit_one_mebibyte_short_fails_and_exact_passes(helm, tmp_path):
    base = VALUE_SETS["pvc-api-server-tp-args"]
    total, _ = expected_host_total(base, vllm_container(render(helm, base, tmp_path)))
    exact = {**base, "resources": {"limits": {"memory": str(total)}}}
    assert vllm_container(render(helm, exact, tmp_path))["resources"]["limits"]["memory"]
    short = {**base, "resources": {"limits": {"memory": f"{(total - 2**20) // 2**20}Mi"}}}
    err = render_fails(helm, short, tmp_path)
    assert "resources.limits.memory" in err and "is too small for the kvtier host tier" in err
    assert f"({total} bytes)" in err


def test_too_small_request_fails(helm, tmp_path):
    values = {
        "kvtier": {"cpuBytes": "64GiB"},
        "resources": {"limits": {"memory": "80Gi"}, "requests": {"memory": "64Gi"}},
    }
    err = render_fails(helm, values, tmp_path)
    assert "resources.requests.memory (64Gi = 64.00 GiB) is too small" in err
    assert "68.00 GiB" in err


def test_auto_tier_needs_room_above_offload_and_headroom(helm, tmp_path):
    # 2 workers x next_pow2(5 GiB) = 16 GiB of pinned offload + 8 GiB headroom = 24 GiB
    values = {
        **VALUE_SETS["auto-tier-offload-tp2"],
        "resources": {"limits": {"memory": "24Gi"}, "requests": {"memory": "24Gi"}},
    }
    err = render_fails(helm, values, tmp_path)
    assert 'with kvtier.cpuBytes "auto"' in err and "24.00 GiB" in err
    values["resources"] = {"limits": {"memory": "25Gi"}, "requests": {"memory": "25Gi"}}
    render(helm, values, tmp_path)


def test_memory_limit_is_required(helm, tmp_path):
    out = run_helm(helm, "template", {}, tmp_path, "--set", "resources.limits=null")
    assert out.returncode != 0
    assert "resources.limits.memory is required" in out.stderr


# ---------------------------------------------------------------- the schema


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kvtier": {"writePolicy": "sometimes"}}, "kvtier.writePolicy must be one of"),
        ({"kvtier": {"chunkSize": "big"}}, "kvtier.chunkSize: Invalid type. Expected: integer"),
        ({"replicaCount": -1}, "replicaCount: Must be greater than or equal to 0"),
        ({"kvtier": {"cacheSize": "8GiB"}}, "Additional property cacheSize is not allowed"),
        ({"kvtier": {"cpuBytes": "lots"}}, "kvtier.cpuBytes: Does not match pattern"),
        ({"kvtier": {"remoteUrl": "http://redis:6379"}}, "kvtier.remoteUrl: Does not match"),
        (
            {"kvtier": {"extraConfig": {"chunk_size": 512}}},
            "Additional property chunk_size is not allowed",
        ),
        (
            {"resources": {"limits": {"memory": "96GB"}}},
            "resources.limits.memory: Does not match pattern",
        ),
        ({"vllm": {"extraArgs": "--max-model-len 8192"}}, "vllm.extraArgs: Invalid type"),
    ],
)
def test_schema_rejects_bad_values_with_a_readable_error(helm, tmp_path, values, message):
    for cmd in ("lint", "template"):
        out = run_helm(helm, cmd, values, tmp_path)
        assert out.returncode != 0, f"helm {cmd} accepted {values}"
        assert message in out.stdout + out.stderr, out.stdout + out.stderr


def test_schema_extra_config_and_chart_keys_are_kvtier_config_keys(helm, tmp_path):
    schema = json.loads((CHART / "values.schema.json").read_text())
    extra_keys = set(schema["properties"]["kvtier"]["properties"]["extraConfig"]["properties"])
    everything = {
        "kvtier": {
            **S3,
            "cpuBytes": "1GiB",
            "namespace": "tenant-1",
            "encryption": {"existingSecret": "kvtier-encryption"},
        },
        "resources": {"limits": {"memory": "8Gi"}, "requests": {"memory": "8Gi"}},
    }
    chart_keys = set(
        transfer_config(vllm_container(render(helm, everything, tmp_path)))[
            "kv_connector_extra_config"
        ]
    )
    assert not extra_keys & chart_keys
    assert extra_keys | chart_keys == set(KEYS)


# ---------------------------------------------------------------- the objects


def test_monitoring_objects(helm, tmp_path):
    on = render(helm, VALUE_SETS["monitoring-on"], tmp_path)
    off = render(helm, VALUE_SETS["monitoring-off"], tmp_path)
    monitoring = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
    assert not [d for d in off if d["kind"] in monitoring or d["kind"] == "ConfigMap"]
    (svc,) = find(on, "Service", "vllm")
    (sm,) = find(on, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "http"
    (pm,) = find(on, "PodMonitor")
    (dep,) = find(on, "Deployment", "vllm")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"


def test_dashboard_and_rules_have_one_source(helm, tmp_path):
    """deploy/grafana and deploy/prometheus are the source; the chart carries copies (a
    symlink there made every render print "found symbolic link"), never drifted ones."""
    for copy, source in [
        ("files/kvtier.json", ROOT / "deploy" / "grafana" / "kvtier.json"),
        ("files/kvtier-rules.yaml", ROOT / "deploy" / "prometheus" / "kvtier-rules.yaml"),
    ]:
        path = CHART / copy
        assert not path.is_symlink(), f"{copy}: helm prints a notice for every symlink"
        assert path.read_bytes() == source.read_bytes(), (
            f"{CHART.relative_to(ROOT)}/{copy} differs from {source.relative_to(ROOT)}, its "
            "source: run `make chart-files` and commit both"
        )
    docs = render(helm, VALUE_SETS["monitoring-on"], tmp_path)
    (cm,) = find(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = (ROOT / "deploy" / "grafana" / "kvtier.json").read_text()
    assert cm["data"]["kvtier.json"] == dashboard
    (rule,) = find(docs, "PrometheusRule")
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kvtier-rules.yaml").read_text())
    assert rule["spec"]["groups"] == rules["groups"]


def test_packaged_chart_carries_the_linked_files(helm, tmp_path):
    """helm package stores the dashboard and rules, so the .tgz stands alone."""
    out = subprocess.run(
        [helm, "package", str(CHART), "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "symbolic link" not in out.stderr, out.stderr
    (tgz,) = tmp_path.glob("kvtier-*.tgz")
    vfile = tmp_path / "values.yaml"
    vfile.write_text(yaml.safe_dump(VALUE_SETS["monitoring-on"]))
    out = subprocess.run(
        [helm, "template", "rel", str(tgz), "-f", str(vfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "symbolic link" not in out.stderr, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (cm,) = find(docs, "ConfigMap")
    assert cm["data"]["kvtier.json"] == (ROOT / "deploy" / "grafana" / "kvtier.json").read_text()
    assert find(docs, "PrometheusRule")[0]["spec"]["groups"]


def test_replicas_share_one_object_tier(helm, tmp_path):
    docs = render(helm, VALUE_SETS["replicas"], tmp_path)
    (dep,) = find(docs, "Deployment", "vllm")
    assert dep["spec"]["replicas"] == 4
    extra = transfer_config(vllm_container(docs))["kv_connector_extra_config"]
    assert extra["remote_url"] == "s3://kv-cache-bucket/prod"


def test_in_chart_redis(helm, tmp_path):
    assert not find(render(helm, {}, tmp_path), "Deployment", "redis")
    docs = render(helm, VALUE_SETS["in-chart-redis"], tmp_path)
    (redis,) = find(docs, "Deployment", "redis")
    (redis_svc,) = find(docs, "Service", "redis")
    assert redis_svc["metadata"]["name"] == "rel-kvtier-redis"
    spec = redis["spec"]["template"]["spec"]
    (rc,) = spec["containers"]
    # the password reaches Redis as an ACL file (test_helm_security.py), never on argv
    assert rc["command"] == ["redis-server", "/etc/redis/conf/redis.conf"]
    assert "args" not in rc and "env" not in rc
    (auth,) = [v for v in spec["volumes"] if v["name"] == "auth"]
    assert auth["secret"]["secretName"] == "kvtier-inchart-redis-4f5a"
    assert auth["secret"]["items"] == [{"key": "redis-password", "path": "password"}]
    (svc,) = find(docs, "Service", "vllm")
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "vllm"
    err = render_fails(
        helm, {"redis": {"enabled": True}, "kvtier": {"remoteUrl": "s3://b/p"}}, tmp_path
    )
    assert "leave kvtier.remoteUrl empty" in err


def test_command_model_gpus_and_args(helm, tmp_path):
    c = vllm_container(render(helm, {}, tmp_path))
    assert c["command"] == ["vllm", "serve"]
    assert c["args"][:3] == ["Qwen/Qwen2.5-7B-Instruct", "--port", "8000"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    docs = render(helm, VALUE_SETS["pvc-api-server-tp-args"], tmp_path)
    c = vllm_container(docs)
    assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert arg_value(c["args"], "--model") == "/models/llama3-8b"
    assert arg_value(c["args"], "--served-model-name") == "llama3"
    assert c["args"][-5:] == [
        "--tensor-parallel-size=2",
        "--cpu-offload-gb",
        "1.5",
        "--max-model-len",
        "8192",
    ]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2  # follows the TP flag
    (dep,) = find(docs, "Deployment", "vllm")
    vols = dep["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models-pvc", "readOnly": True},
    } in vols
    c = vllm_container(render(helm, VALUE_SETS["auto-tier-offload-tp2"], tmp_path))
    assert arg_value(c["args"], "--tensor-parallel-size") == "2"
    assert arg_value(c["args"], "--cpu-offload-gb") == "5"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_vllm_is_given_the_time_kvtier_needs_to_flush_on_stop(helm, tmp_path, name):
    """vLLM's default stop kills the engine at once, losing the object-tier writes still
    queued (connectors/worker/shutdown.py). With an object tier the pod runs vLLM with the window
    kvtier's own rule asks for, and Kubernetes' grace period above it."""
    c = vllm_container(render(helm, VALUE_SETS[name], tmp_path))
    cfg = load_config(transfer_config(c)["kv_connector_extra_config"], environ={})
    need = cfg.vllm_shutdown_timeout_s()
    env = {e["name"]: e.get("value") for e in c.get("env") or []}
    if need is None:
        assert arg_value(c["args"], "--shutdown-timeout") is None
        assert "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS" not in env
        return
    assert arg_value(c["args"], "--shutdown-timeout") == str(need) == "20"
    assert env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == str(need)


def test_shutdown_window_follows_the_flush_and_the_operators_own_flags(helm, tmp_path):
    base = VALUE_SETS["redis-tier"]
    values = {**base, "kvtier": {**base["kvtier"], "extraConfig": {"shutdown_flush_s": 2.5}}}
    c = vllm_container(render(helm, values, tmp_path))
    assert (
        load_config(
            transfer_config(c)["kv_connector_extra_config"], environ={}
        ).vllm_shutdown_timeout_s()
        == 13
    )
    assert arg_value(c["args"], "--shutdown-timeout") == "13"
    # the operator's own flag and variable win, once each
    mine = {
        **base,
        "vllm": {
            "extraArgs": ["--shutdown-timeout=45"],
            "env": [{"name": "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "value": "40"}],
        },
    }
    c = vllm_container(render(helm, mine, tmp_path))
    assert [a for a in c["args"] if a.startswith("--shutdown-timeout")] == ["--shutdown-timeout=45"]
    names = [e["name"] for e in c["env"]]
    assert names.count("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS") == 1
    assert cluster_env(c)["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "40"
    # Kubernetes' grace period must outlast vLLM's stop, the chart's or the operator's
    err = render_fails(helm, {**base, "terminationGracePeriodSeconds": 25}, tmp_path)
    assert "terminationGracePeriodSeconds is 25" in err and "--shutdown-timeout 20" in err, err
    assert render(helm, {**base, "terminationGracePeriodSeconds": 26}, tmp_path)
    err = render_fails(helm, {**mine, "terminationGracePeriodSeconds": 50}, tmp_path)
    assert "--shutdown-timeout 45" in err, err
    # nothing written to an object tier: vLLM's own defaults stand, any grace period goes
    assert render(helm, {"terminationGracePeriodSeconds": 5}, tmp_path)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"vllm": {"extraArgs": ["--kv-transfer-config", "{}"]}},
            "must not hold --kv-transfer-config",
        ),
        (
            {
                "weightOffload": {"cpuOffloadGb": 2},
                "vllm": {"extraArgs": ["--cpu-offload-gb", "2"]},
            },
            "--cpu-offload-gb is set twice",
        ),
        ({"gpu": {"count": 1}, "vllm": {"extraArgs": ["-tp", "4"]}}, "but gpu.count is 1"),
        (
            {"kvtier": {"remoteUrl": "s3://b/p", "redis": {"existingSecret": "x"}}},
            "is not redis:// or rediss://",
        ),
        ({"kvtier": {"extraConfig": {"io_threads": 99}}}, "Must be less than or equal to 64"),
        (
            {"kvtier": {"extraConfig": {"io_threads": "many"}}},
            'must be one of the following: "auto"',
        ),
    ],
)
def test_bad_combinations_fail_with_a_message(helm, tmp_path, values, message):
    out = run_helm(helm, "template", values, tmp_path)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


# ---------------------------------------------------------------- kvtier size --emit helm-values


def kvtier_size(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "size", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize(
    "plan_args",
    [
        [
            "--model",
            str(MODELS / "llama3-8b"),
            "--gpu-memory",
            "80",
            "--warm-sessions",
            "400",
            "--tp",
            "2",
            "--remote-url",
            "s3://kv/llama",
            "--namespace",
            "prod",
        ],
        [
            "--model",
            str(MODELS / "mistral-7b-v0.1"),
            "--gpu-memory",
            "24",
            "--warm-sessions",
            "64",
            "--chunk-size",
            "512",
            "--write-policy",
            "write_back",
        ],
    ],
    ids=["llama3-8b-tp2", "mistral-7b"],
)
def test_kvtier_size_helm_values_drop_into_the_chart(helm, tmp_path, plan_args):
    emitted = yaml.safe_load(kvtier_size(*plan_args, "--emit", "helm-values"))
    plan = json.loads(kvtier_size(*plan_args, "--json"))
    assert isinstance(emitted["kvtier"]["cpuBytes"], int), "these plans need a host tier"
    if emitted["kvtier"].get("remoteUrl"):
        # a shared tier needs a signing key; the user's own values file (-f) names it
        emitted["kvtier"]["hmac"] = {"existingSecret": "kvtier-hmac-3a8f"}
    out = run_helm(helm, "lint", emitted, tmp_path, "--strict")
    assert out.returncode == 0 and "Fail:" not in out.stdout, out.stdout + out.stderr
    c = vllm_container(render(helm, emitted, tmp_path))
    extra = transfer_config(c)["kv_connector_extra_config"]
    assert load_config(extra, environ={}).cpu_bytes == plan["host_tier_bytes"]
    assert extra["chunk_size"] == emitted["kvtier"]["chunkSize"]
    for kind in ("limits", "requests"):
        assert parse_k8s_quantity(c["resources"][kind]["memory"]) >= plan["host_bytes_total"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == plan["tp"]
    assert c["args"][-len(emitted["vllm"]["sizingArgs"]) :] == emitted["vllm"]["sizingArgs"]


def test_kvtier_size_with_weight_offload_and_exact_host_bytes(helm, tmp_path):
    """With offload the planner emits its exact per-worker offload bytes
    (weightOffload.hostBytes); the chart counts those instead of its power-of-two bound."""
    plan_args = [
        "--model",
        str(MODELS / "llama3-8b"),
        "--gpu-memory",
        "80",
        "--warm-sessions",
        "400",
        "--tp",
        "2",
        "--cpu-offload-gb",
        "8",
        "--headroom",
        "6",
    ]
    emitted = yaml.safe_load(kvtier_size(*plan_args, "--emit", "helm-values"))
    plan = json.loads(kvtier_size(*plan_args, "--json"))
    assert "--cpu-offload-gb" in emitted["vllm"]["sizingArgs"]
    assert emitted["weightOffload"]["hostBytes"] == plan["weight_offload_host_bytes"]
    assert size(emitted["kvtier"]["headroom"]) == plan["headroom_bytes"] == 6 * GiB
    c = vllm_container(render(helm, emitted, tmp_path))
    extra = transfer_config(c)["kv_connector_extra_config"]
    assert extra["cpu_headroom_bytes"] == plan["headroom_bytes"]
    limit = parse_k8s_quantity(c["resources"]["limits"]["memory"])
    assert limit >= plan["host_bytes_total"]
    # one byte of offload more than the limit leaves room for must fail
    slack = limit - plan["host_bytes_total"]
    emitted["weightOffload"]["hostBytes"] = plan["weight_offload_host_bytes"] + slack // 2 + 1
    assert "is too small for the kvtier host tier" in render_fails(helm, emitted, tmp_path)


# ---------------------------------------------------------------- README


def test_readme_production_stack_snippet():
    """The production-stack values in the chart's README load kvtier correctly."""
    text = (CHART / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    (snippet,) = [yaml.safe_load(b) for b in blocks if b.startswith("servingEngineSpec:")]
    (spec,) = snippet["servingEngineSpec"]["modelSpec"]
    args = spec["vllmConfig"]["extraArgs"]
    ktc = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "KVTierConnector"
    assert ktc["kv_connector_module_path"] == "kvtier.connectors.vllm"
    assert ktc["kv_role"] == "kv_both"
    assert ktc["kv_load_failure_policy"] == "recompute"
    cfg = load_config(ktc["kv_connector_extra_config"], environ={})
    assert spec["vllmConfig"]["enablePrefixCaching"] is True
    assert "lmcacheConfig" not in spec
    for e in spec["env"]:
        assert set(e) == {"name", "valueFrom"} and "secretKeyRef" in e["valueFrom"]
    assert cfg.hmac_key_env in {e["name"] for e in spec["env"]}
    need = host_total_bytes(cfg.cpu_bytes, headroom_bytes=cfg.cpu_headroom_bytes, tp=1)
    for key in ("requestMemory", "limitMemory"):
        assert parse_k8s_quantity(spec[key]) >= need


def test_the_startup_probe_allows_for_warm_up(helm, tmp_path):
    """vLLM answers /health only once kvtier's warm-up ended or timed out
    (connectors/worker/warmup.py): with warmup on, the startupProbe allows warmup_timeout_s more,
    and so does vLLM's own wait for its engine (VLLM_ENGINE_READY_TIMEOUT_S)."""

    def threshold(extra: dict[str, Any]) -> int:
        base = VALUE_SETS["redis-tier"]
        values = {**base, "kvtier": {**base["kvtier"], "extraConfig": extra}}
        probe = vllm_container(render(helm, values, tmp_path))["startupProbe"]
        assert probe["periodSeconds"] == 10
        return int(probe["failureThreshold"])

    assert threshold({}) == threshold({"warmup": False}) == 120
    assert threshold({"warmup": True}) == 120 + 6 + 1  # 60 s by default, in 10 s periods
    assert threshold({"warmup": True, "warmup_timeout_s": 300}) == 120 + 30 + 1
    assert threshold({"warmup": True, "warmup_timeout_s": 2.5}) == 120 + 1 + 1
    # vLLM's own wait for its engine (600 s) gets the warm-up's time too, unless set
    base = VALUE_SETS["redis-tier"]
    values = {**base, "kvtier": {**base["kvtier"], "extraConfig": {"warmup": True}}}
    env = {e["name"]: e.get("value") for e in vllm_container(render(helm, values, tmp_path))["env"]}
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == "660"
    values["vllm"] = {
        **values.get("vllm", {}),
        "env": [{"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": "900"}],
    }
    env = {e["name"]: e.get("value") for e in vllm_container(render(helm, values, tmp_path))["env"]}
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == "900"
    off = vllm_container(render(helm, base, tmp_path))["env"]
    assert "VLLM_ENGINE_READY_TIMEOUT_S" not in {e["name"] for e in off}
