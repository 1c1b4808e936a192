import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, apply_override, default_aux_layer_ids, load_config
from tests.conftest import REPO

CONFIGS = REPO / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_run_config_loads(path):
    config = load_config(path)
    assert isinstance(config, RunConfig)
    assert Path(config.train.deepspeed_config).name in {
        p.name for p in (CONFIGS / "deepspeed").glob("*.json")
    }


@pytest.mark.parametrize("path", sorted((CONFIGS / "deepspeed").glob("*.json")), ids=lambda p: p.name)
def test_every_deepspeed_config_is_usable(path):
    ds = json.loads(path.read_text())
    assert ds["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert ds["optimizer"]["type"] == "AdamW"


def test_kimi_config_describes_the_production_target():
    config = load_config(CONFIGS / "kimi-k2.5.yaml")
    assert config.storage.root.startswith("s3://")
    assert config.capture.aux_layer_ids == [1, 29, 57]
    assert config.target.hidden_size == 7168
    assert config.target.vocab_size == 163840
    assert config.target.tensor_parallel == 8
    assert config.drafter.draft_vocab_size == 32000
    assert config.generate.engine == "sglang" and config.generate.sglang.urls
    # measured at batch 1, 8 (the headline: 8 requests in flight), 16 and 48 (a replica at capacity: every
    # server's --max-running-requests); promoted only if it wins at 1 and 8
    assert config.benchmark.measured_batch_sizes() == [1, 8, 16, 48]
    assert config.benchmark.sglang.max_running_requests == 48
    assert config.benchmark.gated_batch_sizes() == [1, 8]


def test_batch_sizes_are_checked():
    for overrides, message in [
        (["benchmark.batch_sizes=[4, 4]"], "lists a size twice"),
        (["benchmark.promote_at_batch_sizes=[8]"], r"\[8\] are not measured"),
        (["benchmark.batch_sizes=[0]"], "greater than 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(CONFIGS / "local.yaml", overrides)


def test_unknown_keys_are_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("storage: {root: /tmp/x}\ntarget: {name: t}\ntrain: {epocs: 3}\n")
    with pytest.raises(ConfigError, match="epocs"):
        load_config(path)


def test_dotted_overrides_are_typed_and_validated():
    config = load_config(CONFIGS / "local.yaml", ["train.epochs=2", "gate.min_cond_acc=[0.5, 0.2]"])
    assert config.train.epochs == 2
    assert config.gate.min_cond_acc == [0.5, 0.2]
    with pytest.raises(ConfigError):
        load_config(CONFIGS / "local.yaml", ["train.epochs=many"])
    with pytest.raises(ConfigError):
        load_config(CONFIGS / "local.yaml", ["train.nonsense=1"])
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_override({}, "train.epochs")


def test_ids_that_become_paths_are_validated():
    base = {"storage": {"root": "/tmp/x"}, "target": {"name": "../escape"}}
    with pytest.raises(ConfigError, match="not a valid id"):
        load_config(data=base)


def test_capture_contract_layers_are_checked():
    data = {
        "storage": {"root": "/tmp/x"},
        "target": {"name": "t", "num_layers": 8},
        "capture": {"aux_layer_ids": [1, 3, 9]},
    }
    with pytest.raises(ConfigError, match="out of range"):
        load_config(data=data)
    data["capture"]["aux_layer_ids"] = [3, 1, 5]
    with pytest.raises(ConfigError, match="ascending"):
        load_config(data=data)


def test_default_aux_layers_follow_the_contract():
    assert default_aux_layer_ids(61) == [1, 29, 57]
    assert default_aux_layer_ids(8) == [1, 3, 4]
    with pytest.raises(ConfigError):
        default_aux_layer_ids(4)


def test_a_kubernetes_rendezvous_names_pod_0_in_full():
    """torch makes the node whose own full name is the rendezvous host the store's host; by a short name pod
    0 would ask cluster DNS, which lists it only once it runs, and no node might host the store."""
    data = {"storage": {"root": "/tmp/x"}, "target": {"name": "t"}}
    train = {"nodes": 2, "launcher": "kubernetes"}
    with pytest.raises(ConfigError, match="name pod 0 in full") as refused:
        load_config(
            data={**data, "train": {**train, "rendezvous_endpoint": "drafter-trainer-0.drafter-trainer"}}
        )
    assert "pytorch/pytorch#73682" in str(refused.value)
    full = "drafter-trainer-0.drafter-trainer.drafter.svc.cluster.local"
    assert (
        load_config(data={**data, "train": {**train, "rendezvous_endpoint": full}}).train.rendezvous_endpoint
        == full
    )
    # on one machine the nodes meet at an address, not a pod's name
    assert (
        load_config(data={**data, "train": {"nodes": 2, "rendezvous_endpoint": "127.0.0.1"}}).train.nodes == 2
    )


def test_a_task_pods_identity_and_timeout_are_read_from_its_environment():
    from pipeline.task_pod import (
        TASK_POD_NAME_ENV,
        TASK_POD_UID_ENV,
        TASK_TIMEOUT_ENV,
        task_pod_owner,
        task_timeout_s,
    )

    assert task_pod_owner({}) is None and task_pod_owner({TASK_POD_NAME_ENV: "p"}) is None
    assert task_pod_owner({TASK_POD_NAME_ENV: "p", TASK_POD_UID_ENV: "u"}) == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "p",
        "uid": "u",
    }
    assert task_timeout_s({}) is None and task_timeout_s({TASK_TIMEOUT_ENV: "3600"}) == 3600
    for bad in ("0", "-5", "1.5", "an hour"):
        with pytest.raises(ValueError, match="not a whole number of seconds"):
            task_timeout_s({TASK_TIMEOUT_ENV: bad})
