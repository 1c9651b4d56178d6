"""The chart keeps credentials out of the pod spec wherever a URL holds them, and its
restricted egress sends DNS only to the cluster's DNS.

The credentials guard matched only ``user:pw@``: ``redis://h:6379/0?password=x`` (which
redis-py reads) went into the container's args, readable by anyone who may read the
Deployment. And with ``networkPolicy.egress.restrict`` the DNS rule had no peers, so
the pods could send anything to port 53 of any address (a tunnel out of a locked-down
namespace). Real helm renders every case.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_helm import find_helm, transfer_config, vllm_container
from test_helm_security import HMAC, SCENARIOS, kind, render, render_fails, scenario

pytestmark = pytest.mark.integration

UNSIGNED = {"allowUnsignedChunks": True}


@pytest.fixture(scope="session")
def helm() -> str:
    return find_helm()


def _remote(url: str) -> dict[str, Any]:
    return {"kvtier": {**UNSIGNED, "remoteUrl": url}}


@pytest.mark.parametrize(
    "values",
    [
        _remote("redis://redis.cache:6379/0?password=hunter2"),
        _remote("redis://redis.cache:6379/0?db=1&Password=hunter2"),
        _remote("rediss://redis.cache:6380/0?ssl_ca_certs=/ca.pem&ssl_password=hunter2"),
        _remote("redis://redis.cache:6379/0?pass%77ord=hunter2"),  # a client decodes the name
        _remote("redis://redis.cache:6379/0?x=1#auth_token=hunter2"),
        _remote("redis://kvtier@redis.cache:6379/0"),  # a user name alone is still userinfo
        _remote("s3://kv-cache/prod?X-Amz-Credential=AKIA&X-Amz-Signature=abc"),
        {
            "kvtier": {
                **UNSIGNED,
                "remoteUrl": "s3://kv-cache/prod",
                "s3": {"endpointUrl": "https://AKIAEXAMPLE:secret@s3.internal:9000"},
            }
        },
        {"vllm": {"extraArgs": ["--otlp-traces-endpoint=https://u:hunter2@otel:4317"]}},
        {"vllm": {"env": [{"name": "KVTIER_REMOTE_URL", "value": "redis://h/0?password=x"}]}},
    ],
    ids=[
        "password-arg",
        "Password-arg",
        "ssl_password",
        "encoded-name",
        "in-fragment",
        "user-only",
        "presigned",
        "s3-endpoint",
        "extra-args",
        "plain-env",
    ],
)
def test_credentials_anywhere_in_a_url_are_refused(helm, tmp_path, values) -> None:
    err = render_fails(helm, values, tmp_path)
    assert "holds credentials" in err, err
    assert "hunter2" not in err and "secret@" not in err, "the message repeats the secret"


@pytest.mark.parametrize(
    "url",
    [
        "rediss://redis.cache:6380/0?ssl_ca_certs=/etc/ca/ca.pem",
        "rediss://redis.cache:6380/0?ssl_certfile=/tls/c.pem&ssl_keyfile=/tls/k.pem",
        "redis://redis.cache:6379/2",
        "s3://kv-cache/prod/llama",
        "file:///mnt/shared/kv",
    ],
)
def test_urls_without_credentials_render(helm, tmp_path, url: str) -> None:
    container = vllm_container(render(helm, _remote(url), tmp_path))
    assert transfer_config(container)["kv_connector_extra_config"]["remote_url"] == url


# ---------------------------------------------------------------- DNS egress


def _vllm_policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (np,) = kind(docs, "NetworkPolicy", "vllm")
    return np["spec"]


def _dns_rules(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in spec["egress"] if any(p.get("port") == 53 for p in r.get("ports", []))]


KUBE_DNS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}


@pytest.mark.parametrize("name", ["in-chart-redis", "s3"])
def test_restricted_egress_sends_dns_only_to_the_cluster_dns(helm, tmp_path, name) -> None:
    spec = _vllm_policy(scenario(helm, name, tmp_path))
    assert SCENARIOS[name][2]["networkPolicy"]["egress"]["restrict"] is True
    (dns,) = _dns_rules(spec)
    assert dns["to"] == [KUBE_DNS], "DNS open to any address"
    assert sorted((p["port"], p["protocol"]) for p in dns["ports"]) == [(53, "TCP"), (53, "UDP")]
    for rule in spec["egress"]:
        assert rule.get("to"), f"an egress rule without peers opens its ports to everything: {rule}"


def test_dns_peers_are_a_value(helm, tmp_path) -> None:
    node_local = [{"ipBlock": {"cidr": "169.254.20.10/32"}}]
    values = {
        "redis": {"enabled": True},
        "kvtier": {"hmac": HMAC},
        "networkPolicy": {"egress": {"restrict": True, "dnsTo": node_local}},
    }
    (dns,) = _dns_rules(_vllm_policy(render(helm, values, tmp_path)))
    assert dns["to"] == node_local
    values["networkPolicy"]["egress"] = {"restrict": True, "dns": False}
    assert _dns_rules(_vllm_policy(render(helm, values, tmp_path))) == []


@pytest.mark.parametrize(
    ("dns_to", "message"),
    [
        ([], "networkPolicy.egress.dnsTo: Array must have at least 1 items"),
        ([{}], "Must have at least 1 properties"),
        (None, "networkPolicy.egress.dnsTo is empty"),  # null drops the default
    ],
)
def test_dns_open_to_everything_is_refused(helm, tmp_path, dns_to, message) -> None:
    values = {
        "redis": {"enabled": True},
        "kvtier": {"hmac": HMAC},
        "networkPolicy": {"egress": {"restrict": True, "dnsTo": dns_to}},
    }
    err = render_fails(helm, values, tmp_path)
    assert message in err, err
