"""SGLang fleets scaled around their stages (pipeline.ops.fleets): which replicas a config's URLs need,
refusing URLs that are not the scaled StatefulSet's pods, and which failures are retried. Scaling
through a cluster's API: tests/system/test_fleet_scaling.py."""

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.failures import EXIT_BAD_INPUT, EXIT_FAILED, exit_code_for
from pipeline.ops.fleets import ServerFleet, fleet_urls, replicas_for
from pipeline.ops.kube_api import KubernetesApiError
from tests.conftest import KIMI_CONFIG, REPO

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
    kimi = load_config(KIMI_CONFIG)
    assert len(fleet_urls(kimi, "generate")) == 4 and len(fleet_urls(kimi, "capture")) == 20
    local = load_config(REPO / "configs" / "local.yaml")
    assert fleet_urls(local, "generate") == [] and fleet_urls(local, "capture") == []
    with pytest.raises(ConfigError, match="no server fleet serves stage 'train'"):
        fleet_urls(kimi, "train")


def test_refused_api_calls_are_not_retried_and_unreachable_servers_are():
    assert exit_code_for(KubernetesApiError("PATCH ...: HTTP 403 forbidden", 403)) == EXIT_BAD_INPUT
    assert exit_code_for(KubernetesApiError("PATCH ...: HTTP 404 not found", 404)) == EXIT_BAD_INPUT
    assert exit_code_for(KubernetesApiError("PATCH ...: HTTP 503", 503)) == EXIT_FAILED
    assert exit_code_for(KubernetesApiError("PATCH ...: ConnectionError")) == EXIT_FAILED
