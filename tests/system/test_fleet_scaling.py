"""SGLang fleets scaled around their stages (pipeline.ops.fleets) through the Kubernetes API of the local
cluster (harness.cluster) as a task pod's service account: ready when it returns, back to 0 when it is
not, refused without the role."""

from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from pipeline.config import load_config
from pipeline.failures import EXIT_BAD_INPUT, EXIT_FAILED, exit_code_for
from pipeline.ops.fleets import FleetNotReady, ServerFleet, scale_down, scale_up
from pipeline.ops.kube_api import KubernetesApi, KubernetesApiError
from tests.conftest import tiny_config_dict


# -- against the local cluster's API server, as the task pod does it ---------------------------------
@pytest.fixture
def web_fleet(tmp_path, root):
    """A StatefulSet `ns/web` at 0 replicas, its API, and a service-account token file for `account`."""
    import yaml

    from harness.cluster import LocalCluster, LocalNode
    from tests.system.test_local_cluster import PYTHON, WEB

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
            url = f"http://{address}:{parts.port}/health"
            return address is not None and requests.get(url, timeout=30).ok
        except requests.RequestException:
            return False

    return healthy


def _pods_gone(cluster, timeout_s: float = 60) -> bool:
    """Whether the StatefulSet's pods are all gone within timeout_s: a scale returns once the API took the new
    count, and the controller deletes the pods after it (in the background, on a cluster as here)."""
    from pipeline.retrying import poll_until

    return poll_until(lambda: cluster.statefulset_status("ns", "web")["replicas"] == 0, timeout_s, 0.1)


WEB_FLEET = ServerFleet(namespace="ns", statefulset="web", ready_timeout_seconds=60, poll_seconds=0.2)


def test_a_fleet_is_up_and_answering_when_scale_up_returns_and_gone_after_scale_down(web_fleet, tmp_path):
    cluster, api_as = web_fleet
    api = api_as("scaler")
    scaled = scale_up(_web_config(tmp_path, 2), "generate", WEB_FLEET, api, _healthy_through(cluster))
    assert scaled["replicas"] == 2 and scaled["scaled"] is True
    assert cluster.statefulset_status("ns", "web")["readyReplicas"] == 2
    assert all(_healthy_through(cluster)(f"http://web-{i}.web.ns.svc:8080") for i in range(2))
    assert scale_down(WEB_FLEET, api)["replicas"] == 0
    assert _pods_gone(cluster)
    assert cluster.address_of("web-0.web.ns.svc") is None


def test_a_fleet_that_never_answers_goes_back_to_zero_and_the_failure_is_retried(web_fleet, tmp_path):
    cluster, api_as = web_fleet
    fleet = WEB_FLEET.model_copy(update={"ready_timeout_seconds": 3})
    with pytest.raises(
        FleetNotReady, match=r"ns/web: 1/1 replicas ready .* not answering: http://web-0"
    ) as failure:
        scale_up(_web_config(tmp_path, 1), "generate", fleet, api_as("scaler"), healthy=lambda url: False)
    assert _pods_gone(cluster)
    assert exit_code_for(failure.value) == EXIT_FAILED


def test_an_account_without_the_role_is_refused_and_not_retried(web_fleet, tmp_path):
    cluster, api_as = web_fleet
    with pytest.raises(KubernetesApiError, match="HTTP 403") as refused:
        scale_up(_web_config(tmp_path, 1), "generate", WEB_FLEET, api_as("stranger"))
    assert exit_code_for(refused.value) == EXIT_BAD_INPUT
    assert cluster.statefulset_status("ns", "web")["replicas"] == 0
