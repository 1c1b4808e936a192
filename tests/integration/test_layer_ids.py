"""Which layer outputs SGLang 0.5.23 and vLLM capture for a draft config's aux layer ids, per model family
(pipeline.engines.layer_ids), and everything that writes or reads such ids agreeing with it: export, the
draft checks, the capture-server check, the stand-in server, HF capture and the config checks."""

from __future__ import annotations

import torch

from pipeline.engines.layer_ids import draft_config_ids, model_family_of
from tests.conftest import TEST_CACHE

# ---- the model family --------------------------------------------------------------------------------------


def test_the_tiny_targets_are_one_of_each_family(tiny_target_dir, kimi_target_dir):
    assert model_family_of(tiny_target_dir) == "llama"
    assert model_family_of(kimi_target_dir) == "deepseek"


# ---- ids -> captured layer outputs -------------------------------------------------------------------------


# ---- export and the draft checks ---------------------------------------------------------------------------


# ---- capture servers, the stand-in, HF capture -------------------------------------------------------------


# ---- the config checks -------------------------------------------------------------------------------------


def test_the_targets_identity_records_its_family_for_the_exporter(kimi_target_dir, tiny_target_dir):
    from pipeline.config import load_config
    from pipeline.engines.target import describe_target

    for model_dir, family in ((kimi_target_dir, "deepseek"), (tiny_target_dir, "llama")):
        config = load_config(
            data={
                "storage": {"root": str(model_dir.parent / "store"), "local_cache": str(TEST_CACHE)},
                "target": {
                    "name": "t",
                    "source": "hf",
                    "model_path": str(model_dir),
                    "trust_remote_code": True,
                },
            }
        )
        assert describe_target(config).identity["model_family"] == family


def test_the_stand_in_captures_the_layers_sglang_would_for_the_flag_it_is_given(kimi_target_dir):
    """On the DeepSeek-family tiny target, --return-aux-hidden-state-layer-ids 3 4 5 captures the outputs
    of layers 2, 3, 4 (ids not starting at 1 are taken unshifted): what HF capture of [2, 3, 4] holds."""
    from harness.sglang_standin import StandinBackend
    from pipeline.engines.hf import HFEngine

    layers = [2, 3, 4]
    flag = draft_config_ids("sglang", "deepseek", layers, 6)
    assert flag == [3, 4, 5]
    sequence = [1013, 10, 11, 12, 1010, 20, 21]
    backend = StandinBackend(kimi_target_dir, flag, trust_remote_code=True)
    assert backend.server_info()["return_aux_hidden_state_layer_ids"] == flag
    served = backend.generate_one(
        {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_hidden_states": True}, sequence
    )
    aux = torch.tensor(served["meta_info"]["hidden_states"][0])
    [captured] = HFEngine(kimi_target_dir, trust_remote_code=True).capture([sequence], layers)
    torch.testing.assert_close(aux, captured.aux.float(), rtol=1e-4, atol=1e-5)
