"""An eagle3-mla drafter trained by the real trainer (torchrun, TTT, masks, the best-epoch export) on the tiny
DeepSeek-shaped target's captured data, evaluated by the evaluate stage, and exported as SGLang's
Eagle3DeepseekV2ForCausalLM that SGLang 0.5.23's load checks accept."""

import copy
import json

import pytest

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.drafter.export import read_drafter_dir
from pipeline.engines.sglang_draft_checks import SpeculativeArgs, draft_model_problems
from pipeline.ops.registry import RegistryError, promote, pull
from pipeline.records import EvalRecord, read_record
from pipeline.stages import run_stage
from pipeline.stages.evaluate import local_drafter_dir
from pipeline.storage import open_store
from tests.builders import SERVING
from tests.conftest import KIMI_TEST_RECIPE, captured_dataset, published, storage_config, tiny_config_dict


def test_an_mla_drafter_trains_on_the_tiny_kimi_target_and_is_evaluated(tmp_path, kimi_target_dir, capsys):
    data = tiny_config_dict(storage_config("file", tmp_path, None))
    data["target"] = {
        "name": "tiny-kimi-mla",
        "source": "tiny",
        "tiny": copy.deepcopy(KIMI_TEST_RECIPE),
        "trust_remote_code": True,
    }
    data["prompts"].update({"num_samples": 40, "shard_size": 20, "eval_fraction": 0.25})
    data["generate"]["max_new_tokens"] = 16
    data["capture"].update({"parity": {"samples": 0}, "aux_layer_ids": [1, 2, 3]})
    data["drafter"]["architecture"] = "eagle3-mla"
    data["train"].update({"epochs": 2, "nproc": 1, "log_every": 1})
    config = load_config(data=data)
    store = open_store(config.storage)
    dataset = captured_dataset(config, store, "d")
    trained = run_stage("train", config, "mla", store, dataset_uri=dataset)
    history = published(store, trained)["history"]
    assert len(history) == 2 and all(epoch["heldout"]["tau_simulated"] >= 1.0 for epoch in history)
    evaluation = run_stage("evaluate", config, "mla", store, dataset_uri=dataset)
    record = read_record(store, evaluation.uri, EvalRecord)
    assert record.tau_simulated >= 1.0 and len(record.cond_acc) == config.train.ttt_steps

    drafter_dir = local_drafter_dir(store, store.key_for(trained.uri), tmp_path / "fetched")
    drafter_config, tensors, _ = read_drafter_dir(drafter_dir)
    assert drafter_config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    target = json.loads((kimi_target_dir / "config.json").read_text())
    assert drafter_config["kv_lora_rank"] == target["kv_lora_rank"]
    assert "midlayer.self_attn.kv_b_proj.weight" in tensors
    assert draft_model_problems(kimi_target_dir, drafter_dir, SpeculativeArgs("EAGLE3", 3, 1, 4)) == []

    # published and pulled like any drafter; `drafter verify` says that no engine here loads it, and a pull
    # for vLLM is refused with the reason
    promote(store, "tiny-kimi-mla", drafter_dir, {"run_id": "mla"}, "production", SERVING)
    served = pull(store, "tiny-kimi-mla", "production", tmp_path / "served")
    capsys.readouterr()
    assert main(["verify", str(served)]) == 0
    printed = capsys.readouterr().out
    assert "SGLang would serve it" in printed
    said = "no engine here loads this eagle3-mla drafter: its MLA latent is 24 wide"  # 16 + 8
    assert said in printed and published(store, trained)["result"]["no_engine_here"].startswith(said)
    with pytest.raises(RegistryError, match="takes latents of 320, 512 or 576 only"):
        pull(store, "tiny-kimi-mla", "production", tmp_path / "for-vllm", engine="vllm")
