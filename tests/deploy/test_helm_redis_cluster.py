"""The chart with an external Redis Cluster: the seed list and TLS query reach kvtier, the
password only through the environment Kubernetes assembles from a Secret."""

from __future__ import annotations

from typing import Any

import pytest
from test_helm import (
    cluster_env,
    find_helm,
    render,
    render_fails,
    run_helm,
    transfer_config,
    vllm_container,
)

from kvtier.config import cluster_seeds, load_config

CLUSTER = {
    "kvtier": {
        "remoteUrl": "rediss+cluster://rc-0.rc.cache.svc:6379,rc-1.rc.cache.svc:6380/"
        "?ssl_ca_certs=/etc/kvtier/redis-ca/ca.crt",
        "redis": {"existingSecret": "kvtier-redis-auth-9b2d", "username": "kvtier"},
        "hmac": {"existingSecret": "kvtier-hmac-3a8f"},
    },
    "extraVolumes": [{"name": "redis-ca", "secret": {"secretName": "rc-ca"}}],
    "extraVolumeMounts": [
        {"name": "redis-ca", "mountPath": "/etc/kvtier/redis-ca", "readOnly": True}
    ],
}


@pytest.fixture(scope="session")
def helm() -> str:
    return find_helm()


def test_cluster_values_lint(helm, tmp_path) -> None:
    out = run_helm(helm, "lint", CLUSTER, tmp_path, "--strict")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Fail:" not in out.stdout + out.stderr


def test_cluster_url_gets_the_password_from_the_secret(helm, tmp_path) -> None:
    c = vllm_container(render(helm, CLUSTER, tmp_path))
    extra = transfer_config(c)["kv_connector_extra_config"]
    assert "fakeRedisPw9b2dNoInline" not in str(c)
    cfg = load_config(extra, environ=cluster_env(c))
    assert cfg.remote_url == (
        "rediss+cluster://kvtier:fakeRedisPw9b2dNoInline@rc-0.rc.cache.svc:6379,"
        "rc-1.rc.cache.svc:6380/?ssl_ca_certs=/etc/kvtier/redis-ca/ca.crt"
    )
    assert cluster_seeds(cfg.remote_url) == [
        ("rc-0.rc.cache.svc", 6379),
        ("rc-1.rc.cache.svc", 6380),
    ]


@pytest.mark.parametrize(
    "url", ["redis+cluster://h1:6379,h2:6379/", "rediss+cluster://h1:6379/?ssl_ca_certs=/ca"]
)
def test_schema_takes_cluster_urls(helm, tmp_path, url: str) -> None:
    values: dict[str, Any] = {"kvtier": {**CLUSTER["kvtier"], "remoteUrl": url}}
    render(helm, values, tmp_path)


def test_a_password_in_the_cluster_url_is_refused(helm, tmp_path) -> None:
    values = {"kvtier": {**CLUSTER["kvtier"], "remoteUrl": "redis+cluster://:pw@h1:6379/"}}
    assert "kvtier.remoteUrl" in render_fails(helm, values, tmp_path)
