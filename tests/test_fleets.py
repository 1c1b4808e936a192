"""SGLang fleets scaled around their stages (pipeline.ops.fleets): which replicas a config's URLs need,
refusing URLs that are not the scaled StatefulSet's pods, and scaling through the Kubernetes API of the
local cluster (pipeline.dev.cluster) as a task pod's service account: ready when it returns, back to 0
when it is not, refused without the role."""

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from pipeline.config import ConfigError, load_config
from pipeline.failures import EXIT_BAD_INPUT, EXIT_FAILED, exit_code_for
from pipeline.ops.fleets import FleetNotReady, ServerFleet, fleet_urls, replicas_for, scale_down, scale_up
from pipeline.ops.kube_api import KubernetesApi, KubernetesApiError
from tests.conftest import REPO, tiny_config_dict

GENERATE = ServerFleet(namespace="sglang", statefulset="sglang-generate")


def test_replicas_cover_the_highest_pod_the_urls_name():
    urls = [f"http://sglang-generate-{i}.sglang-generate.sglang.svc:30000" for i in (0, 2)]
    assert replicas_for(urls, GENERATE, "generate") == 3
    assert (
        replicas_for(
            ["http://sglang-generate-0.sglang-generate.sglang.svc.cluster.local:30000"], GENERATE, "generate"
        )
        == 1
    )
    assert replicas_for([], GENERATE, "generate") == 0


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.7:30000",
        "http://sglang-capture-aux-0.sglang-capture-aux.sglang.svc:30000",
        "http://sglang-generate-0.sglang-generate.other.svc:30000",
    ],
)
def test_a_url_outside_the_scaled_statefulset_is_refused(url):
    urls = ["http://sglang-generate-0.sglang-generate.sglang.svc:30000", url]
    with pytest.raises(
        ConfigError,
        match=r"generate.sglang.urls\[1\] .* is not a pod of StatefulSet "
        r"sglang/sglang-generate",
    ):
        replicas_for(urls, GENERATE, "generate")


def test_only_sglang_stages_have_servers_to_scale():
    kimi = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    assert len(fleet_urls(kimi, "generate")) == 4 and len(fleet_urls(kimi, "capture")) == 2
    local = load_config(REPO / "configs" / "local.yaml")
    assert fleet_urls(local, "generate") == [] and fleet_urls(local, "capture") == []
    with pytest.raises(ConfigError, match="no server fleet serves stage 'train'"):
        fleet_urls(kimi, "train")


def test_refused_api_calls_are_not_retried_and_unreachable_servers_are():
    assert exit_code_for(KubernetesApiError("PATCH ...: HTTP 403 forbidden", 403)) == EXIT_BAD_INPUT
    assert exit_code_for(KubernetesApiError("PATCH ...: HTTP 404 not found", 404)) == EXIT_BAD_INPUT
    assert exit_code_for(KubernetesApiError("PATCH ...: HTTP 503", 503)) == EXIT_FAILED
    assert exit_code_for(KubernetesApiError("PATCH ...: ConnectionError")) == EXIT_FAILED


# -- against the local cluster's API server, as the task pod does it ---------------------------------
@pytest.fixture
def web_fleet(tmp_path):
    """A StatefulSet `ns/web` at 0 replicas, its API, and a service-account token file for `account`."""
    import yaml

    from pipeline.dev.cluster import LocalCluster, LocalNode
    from tests.test_local_cluster import PYTHON, WEB

    if os.geteuid() != 0:
        pytest.skip("containers need root (mount and PID namespaces)")
    manifest = tmp_path / "web.yaml"
    manifest.write_text(yaml.safe_dump_all(WEB))
    cluster = LocalCluster(
        tmp_path / "cluster", {"python": PYTHON}, (LocalNode("cpu", {}, (), {"cpu": "8"}),)
    )
    cluster.apply(manifest)
    cluster.start_api()

    def api_as(account: str) -> KubernetesApi:
        token = tmp_path / f"{account}.token"
        token.write_text(cluster.service_account_token("ns", account))
        return KubernetesApi(cluster.api.url, token, Path(cluster.api.ca_file))

    yield cluster, api_as
    cluster.shutdown()


def _web_config(tmp_path, pods: int):
    config = tiny_config_dict({"root": str(tmp_path / "store"), "local_cache": str(tmp_path / "cache")})
    config["generate"].update(
        engine="sglang", sglang={"urls": [f"http://web-{i}.web.ns.svc:8080" for i in range(pods)]}
    )
    return load_config(data=config)


def _healthy_through(cluster):
    """/health of a pod's URL from this process (the host has no cluster DNS: the cluster resolves it)."""

    def healthy(url: str) -> bool:
        parts = urlsplit(url)
        address = cluster.address_of(parts.hostname)
        try:
            return address is not None and requests.get(f"http://{address}:{parts.port}/health", timeout=5).ok
        except requests.RequestException:
            return False

    return healthy


WEB_FLEET = ServerFleet(namespace="ns", statefulset="web", ready_timeout_seconds=60, poll_seconds=0.2)


def test_a_fleet_is_up_and_answering_when_scale_up_returns_and_gone_after_scale_down(web_fleet, tmp_path):
    cluster, api_as = web_fleet
    api = api_as("scaler")
    scaled = scale_up(_web_config(tmp_path, 2), "generate", WEB_FLEET, api, _healthy_through(cluster))
    assert scaled["replicas"] == 2 and scaled["scaled"] is True
    assert cluster.statefulset_status("ns", "web")["readyReplicas"] == 2
    assert all(_healthy_through(cluster)(f"http://web-{i}.web.ns.svc:8080") for i in range(2))
    assert scale_down(WEB_FLEET, api)["replicas"] == 0
    assert cluster.statefulset_status("ns", "web")["replicas"] == 0
    assert cluster.address_of("web-0.web.ns.svc") is None


def test_a_fleet_that_never_answers_goes_back_to_zero_and_the_failure_is_retried(web_fleet, tmp_path):
    cluster, api_as = web_fleet
    fleet = WEB_FLEET.model_copy(update={"ready_timeout_seconds": 3})
    with pytest.raises(
        FleetNotReady, match=r"ns/web: 1/1 replicas ready .* not answering: http://web-0"
    ) as failure:
        scale_up(_web_config(tmp_path, 1), "generate", fleet, api_as("scaler"), healthy=lambda url: False)
    assert cluster.statefulset_status("ns", "web")["replicas"] == 0
    assert exit_code_for(failure.value) == EXIT_FAILED


def test_an_account_without_the_role_is_refused_and_not_retried(web_fleet, tmp_path):
    cluster, api_as = web_fleet
    with pytest.raises(KubernetesApiError, match="HTTP 403") as refused:
        scale_up(_web_config(tmp_path, 1), "generate", WEB_FLEET, api_as("stranger"))
    assert exit_code_for(refused.value) == EXIT_BAD_INPUT
    assert cluster.statefulset_status("ns", "web")["replicas"] == 0
