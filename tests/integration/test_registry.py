"""Registry on both backends: promote, aliases, rollback, verified pull, refusals."""

import json
import shlex

import pytest

from pipeline import layout
from pipeline.drafter.export import export_drafter
from pipeline.engines.sglang_draft_checks import DraftModelRefused
from pipeline.ops.registry import (
    RegistryError,
    list_versions,
    promote,
    pull,
    read_alias,
    rollback,
    verify_dir,
)
from tests.builders import CONTRACT, SERVING, SMALL_TARGET, drafter_dir, small_drafter
from tests.conftest import KIMI_CONFIG


def hand_edit_published_config(store, target, version, **changes):
    """Edit a published version's config.json and its manifest entry, as a hand edit before an older
    pipeline published it would have left it: the checksums agree, the content is what changed."""
    import hashlib

    prefix = layout.drafter_version_prefix(target, version)
    config = json.loads(store.get_bytes(f"{prefix}/config.json"))
    data = json.dumps({**config, **changes}, indent=2).encode()
    manifest = json.loads(store.get_bytes(f"{prefix}/manifest.json"))
    entry = next(o for o in manifest["objects"] if o["name"] == "config.json")
    entry.update({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    store.put_bytes(f"{prefix}/config.json", data)
    store.put_bytes(f"{prefix}/manifest.json", json.dumps(manifest).encode())


def test_promote_then_pull_and_verify(store, tmp_path):
    promoted = promote(
        store,
        "tgt",
        drafter_dir(tmp_path, 1),
        {"run_id": "r1", "eval": {"tau_simulated": 2.0}},
        "production",
        SERVING,
    )
    assert read_alias(store, "tgt", "production")["version"] == promoted["version"]
    dest = pull(store, "tgt", "production", tmp_path / "served")
    manifest = verify_dir(dest)
    assert manifest["version"] == promoted["version"]
    assert {p.name for p in dest.iterdir()} == {
        "config.json",
        "model.safetensors",
        "capture_contract.json",
        "target_config.json",
        "README.md",
        "manifest.json",
        ".drafter-pull.json",  # what the pull wrote (registry.PULL_MARKER)
    }
    card = (dest / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in card and "--speculative-num-steps 3" in card
    assert [v["version"] for v in list_versions(store, "tgt")] == [promoted["version"]]


def test_second_promotion_moves_previous_and_rollback_restores(store, tmp_path):
    first = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)[
        "version"
    ]
    second = promote(store, "tgt", drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)[
        "version"
    ]
    assert first != second
    assert read_alias(store, "tgt", "previous")["version"] == first
    rollback(store, "tgt")
    assert read_alias(store, "tgt", "production")["version"] == first
    assert read_alias(store, "tgt", "previous")["version"] == second
    history = [json.loads(store.get_bytes(k)) for k in store.list(layout.registry_prefix("tgt", "history"))]
    assert [h["reason"] for h in history if h["alias"] == "production"][-1] == "rollback"


def test_pull_of_a_missing_alias_is_a_clear_error(store, tmp_path):
    with pytest.raises(RegistryError, match="no alias or version named 'production'"):
        pull(store, "tgt", "production", tmp_path / "served")
    assert not (tmp_path / "served").exists()


def test_verify_detects_a_tampered_directory(store, tmp_path):
    promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    dest = pull(store, "tgt", "production", tmp_path / "served")
    (dest / "config.json").write_text(
        (dest / "config.json").read_text().replace('"num_hidden_layers": 1', '"num_hidden_layers": 2')
    )
    with pytest.raises(RegistryError, match="checksum mismatch for config.json"):
        verify_dir(dest)


class RacingStore:
    """Wraps a store so that N promoters reach each alias step together: all of them read the alias
    before any writes it, and all of them attempt their first conditional alias write (`previous`, which a
    promotion moves first) at the same moment."""

    def __init__(self, store, parties):
        import threading

        self.store, self.read_barrier, self.write_barrier = (
            store,
            threading.Barrier(parties),
            threading.Barrier(parties),
        )
        self.waited = threading.local()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def read_with_tag(self, key):
        if key.endswith("aliases/production.json") and not getattr(self.waited, "read", False):
            self.waited.read = True
            self.read_barrier.wait(timeout=60)
        return self.store.read_with_tag(key)

    def put_if(self, key, data, expected_tag):
        if "/aliases/" in key and not getattr(self.waited, "write", False):
            self.waited.write = True
            self.write_barrier.wait(timeout=60)
        return self.store.put_if(key, data, expected_tag)


@pytest.fixture
def serialized_store(storage, tmp_path):
    """For S3: moto's app behind a single-threaded server, so a conditional PUT is atomic as on S3
    (moto checks If-Match and writes in two steps; S3 does both at once)."""
    if not storage["root"].startswith("s3://"):
        yield store_for(storage)
        return
    import threading

    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    server = make_server(
        "127.0.0.1",
        0,
        DomainDispatcherApplication(create_backend_app),
        False,
        request_handler=MotoRequestHandler,
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield store_for({**storage, "endpoint_url": f"http://127.0.0.1:{server.server_port}"})
    server.shutdown()


def store_for(storage):
    from pipeline.storage import StorageConfig, open_store

    return open_store(StorageConfig(**storage))


@pytest.mark.parametrize("racers", [2, 3])
def test_racing_promoters_exactly_one_wins_and_the_alias_is_never_torn(serialized_store, tmp_path, racers):
    import threading

    from pipeline.ops.registry import AliasConflict

    promote(serialized_store, "tgt", drafter_dir(tmp_path, 0), {"run_id": "base"}, "production", SERVING)
    racing = RacingStore(serialized_store, racers)
    outcomes = {}

    def contender(index):
        try:
            outcomes[index] = promote(
                racing,
                "tgt",
                drafter_dir(tmp_path, index + 1),
                {"run_id": f"r{index}"},
                "production",
                SERVING,
            )["version"]
        except AliasConflict as conflict:
            outcomes[index] = conflict

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    winners = [v for v in outcomes.values() if isinstance(v, str)]
    losers = [v for v in outcomes.values() if isinstance(v, AliasConflict)]
    assert len(winners) == 1 and len(losers) == racers - 1
    assert all("nothing changed" in str(loser) for loser in losers)
    alias = read_alias(serialized_store, "tgt", "production")
    assert alias["version"] == winners[0]
    moves = [
        json.loads(serialized_store.get_bytes(k))
        for k in serialized_store.list(layout.registry_prefix("tgt", "history"))
    ]
    assert [m["version"] for m in moves if m["alias"] == "production"][-1] == winners[0]
    assert len([m for m in moves if m["alias"] == "production"]) == 2  # the base promotion and the winner


def test_a_stale_promotion_is_refused(store, tmp_path):
    from pipeline.ops.registry import AliasConflict, move_alias

    first = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)[
        "version"
    ]
    second = promote(store, "tgt", drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)[
        "version"
    ]
    with pytest.raises(AliasConflict, match=f"is at {second}, not {first}"):
        move_alias(store, "tgt", "production", first, "stale decision", expected=first)
    assert read_alias(store, "tgt", "production")["version"] == second


class ReadOnlyStore:
    """What a server's read-only role allows: GetObject (and HEAD) on drafters/*, nothing else."""

    def __init__(self, store):
        self.store = store
        self.root_uri = store.root_uri

    def __getattr__(self, name):
        if name in (
            "get_bytes",
            "get_file",
            "get_file_verified",
            "get_verified",
            "exists",
            "read_with_tag",
            "uri",
            "key_for",
        ):
            return getattr(self.store, name)
        raise PermissionError(f"a reader may not call {name}")


def test_a_read_only_role_is_enough_to_pull(store, tmp_path):
    promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    dest = pull(ReadOnlyStore(store), "tgt", "production", tmp_path / "served")
    assert verify_dir(dest)["target"] == "tgt"


def test_plain_sync_of_a_version_then_verify(store, tmp_path):
    version = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)[
        "version"
    ]
    prefix = layout.drafter_version_prefix("tgt", version)
    synced = tmp_path / "synced"
    synced.mkdir()
    for key in store.list(prefix):  # what `aws s3 sync s3://.../versions/<v>/ DIR` copies
        store.get_file(key, synced / key[len(prefix) + 1 :])
    assert verify_dir(synced)["version"] == version


@pytest.mark.parametrize(
    "target, alias", [("../../etc", "production"), ("tgt", "../production"), ("tgt", "a/b"), ("tgt", "")]
)
def test_names_that_would_escape_the_registry_are_refused(store, tmp_path, target, alias):
    from pipeline.ids import InvalidIdError

    with pytest.raises((InvalidIdError, RegistryError)):
        pull(store, target, alias, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_pull_and_verify_refuse_a_drafter_with_a_shorter_context_than_the_target(
    store, tmp_path, monkeypatch
):
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    good = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)["version"]
    served = pull(store, "tgt", "production", tmp_path / "served")
    bad = promote(store, "tgt", drafter_dir(tmp_path, 2), {"run_id": "r2"}, "production", SERVING)["version"]
    hand_edit_published_config(store, "tgt", bad, max_position_embeddings=1024)
    reason = "derived context length 1024 .* shorter than the target's 2048"
    with pytest.raises(RegistryError, match=reason):
        pull(store, "tgt", "production", served)
    assert verify_dir(served)["version"] == good  # what was served stays
    synced = tmp_path / "synced"
    synced.mkdir()
    prefix = layout.drafter_version_prefix("tgt", bad)
    for key in store.list(prefix):
        store.get_file(key, synced / key[len(prefix) + 1 :])
    with pytest.raises(DraftModelRefused, match=reason):
        verify_dir(synced)


def test_verify_checks_against_a_given_target_config(store, tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    dest = pull(store, "tgt", "production", tmp_path / "served")
    longer = tmp_path / "longer" / "config.json"
    longer.parent.mkdir()
    longer.write_text(json.dumps({**SMALL_TARGET, "max_position_embeddings": 8192, "vocab_size": 64}))
    with pytest.raises(DraftModelRefused) as refused:
        verify_dir(dest, longer)
    assert "shorter than the target's 8192" in str(refused.value)
    assert "draft vocab_size 50 differs from the target's 64" in str(refused.value)
    assert verify_dir(dest, longer.parent.parent / "target")["version"]  # a model directory works too


def test_a_drafter_without_a_recorded_target_is_not_published(store, tmp_path):
    from pipeline.drafter.servable import NoTargetConfig

    bare = export_drafter(small_drafter(1), CONTRACT, tmp_path / "bare", "float32")
    with pytest.raises(NoTargetConfig, match="records no target_config.json"):
        promote(store, "tgt", bare, {"run_id": "r1"}, "production", SERVING)
    assert store.list("drafters") == []


def promoted_kimi_version(tmp_path, serving=SERVING, lineage=None):
    """A Kimi-like drafter (a DeepSeek-family target of 6 layers, trained on layers AUX) promoted to
    production of kimi-k2.5 in a filesystem store; returns the store and `drafter pull` argv for it."""
    from pipeline.storage import StorageConfig, open_store
    from tests.builders import AUX, drafter_for, kimi_like_target

    store = open_store(StorageConfig(root=str(tmp_path / "store")))
    target_dir = kimi_like_target(tmp_path / "kimi")
    contract = {
        "aux_layer_ids": AUX,
        "num_layers": 6,
        "hidden_size": 16,
        "target": {"model_family": "deepseek"},
    }
    drafter = export_drafter(
        drafter_for(tmp_path, target_dir), contract, tmp_path / "d", "float32", target_dir
    )
    promote(store, "kimi-k2.5", drafter, lineage or {"run_id": "r1"}, "production", serving)
    config = str(KIMI_CONFIG)
    return store, ["pull", "--config", config, f"storage.root={tmp_path / 'store'}"]


def test_drafter_pull_prints_the_complete_sglang_command_for_kimi(tmp_path, capsys, monkeypatch):
    from pipeline.cli import main

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    _, pull_argv = promoted_kimi_version(tmp_path)
    dest, flags_file = tmp_path / "current", tmp_path / "serving-flags"
    assert main([*pull_argv, "--dest", str(dest), "--flags-file", str(flags_file)]) == 0
    out, err = capsys.readouterr()
    printed = out.splitlines()[-1]
    # a version promoted before the benchmark set the load: the config's benchmark.sglang.max_running_requests
    assert "records no max_running_requests" in err and "max_running_requests 48" in err
    speculative = [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(dest),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--max-running-requests", "48",
    ]  # fmt: skip
    assert shlex.split(printed.removeprefix("serve with: ")) == [
        "python", "-m", "sglang.launch_server", "--model-path", "/models/Kimi-K2.5",
        "--tp", "8", "--trust-remote-code", *speculative,
    ]  # fmt: skip
    assert shlex.split(flags_file.read_text()) == ["--tp", "8", "--trust-remote-code", *speculative]
    assert "--context-length" not in printed  # the drafter has the target's 262,144 positions


def test_a_version_serves_at_the_load_its_benchmark_ran_every_server_at(tmp_path, capsys, monkeypatch):
    """The promotion records benchmark.sglang.max_running_requests with the setting; the serving pods'
    flags carry it (unset, SGLang 0.5.23 would run EAGLE at 48), whatever the config now says."""
    from pipeline.cli import main

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    _, pull_argv = promoted_kimi_version(tmp_path, serving={**SERVING, "max_running_requests": 32})
    dest, flags_file = tmp_path / "current", tmp_path / "serving-flags"
    assert main([*pull_argv, "--dest", str(dest), "--flags-file", str(flags_file)]) == 0
    flags = shlex.split(flags_file.read_text())
    assert flags[-2:] == ["--max-running-requests", "32"] and flags.count("--max-running-requests") == 1
    assert "records no max_running_requests" not in capsys.readouterr().err


def test_drafter_verify_names_the_reason_sglang_would_refuse(store, tmp_path, capsys, caplog, monkeypatch):
    from pipeline.cli import main
    from pipeline.failures import EXIT_BAD_INPUT

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    dest = pull(store, "tgt", "production", tmp_path / "served")
    assert main(["verify", str(dest)]) == 0
    assert "SGLang would serve it for the target of" in capsys.readouterr().out
    longer = tmp_path / "longer.json"
    longer.write_text(json.dumps({**SMALL_TARGET, "max_position_embeddings": 8192}))
    assert main(["verify", str(dest), "--target-config", str(longer)]) == EXIT_BAD_INPUT
    assert "shorter than the target's 8192" in caplog.text


def test_drafter_pull_for_vllm_prints_vllm_serve_with_the_speculative_config(tmp_path, capsys, monkeypatch):
    from pipeline.cli import main

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    _, pull_argv = promoted_kimi_version(tmp_path)
    dest, flags_file = tmp_path / "current", tmp_path / "vllm-flags"
    argv = [*pull_argv, "--dest", str(dest), "--engine", "vllm", "--flags-file", str(flags_file)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    command = shlex.split(captured.out.splitlines()[-1].removeprefix("serve with: "))
    assert command[:-1] == [
        "vllm", "serve", "/models/Kimi-K2.5", "--tensor-parallel-size", "8", "--trust-remote-code",
        "--speculative-config",
    ]  # fmt: skip
    speculative = {"method": "eagle3", "model": str(dest), "num_speculative_tokens": 3}
    assert json.loads(command[-1]) == speculative
    assert shlex.split(flags_file.read_text())[:-1] == command[3:-1]
    assert json.loads(shlex.split(flags_file.read_text())[-1]) == speculative
    assert "chain" not in captured.err  # the benchmarked setting is a chain already
    # vLLM is given the ids that capture the trained layers [1, 2, 3] (its id k: the input of layer k)
    assert json.loads((dest / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]


def test_pulling_a_tree_setting_for_vllm_says_vllm_serves_a_chain(tmp_path, capsys, monkeypatch):
    from pipeline.cli import main

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    _, pull_argv = promoted_kimi_version(tmp_path, serving={"steps": 3, "topk": 4, "draft_tokens": 8})
    assert main([*pull_argv, "--dest", str(tmp_path / "current"), "--engine", "vllm"]) == 0
    captured = capsys.readouterr()
    assert "vLLM serves a chain of 3 speculative tokens" in captured.err and "topk 4" in captured.err
    speculative = json.loads(shlex.split(captured.out.splitlines()[-1])[-1])
    assert speculative["num_speculative_tokens"] == 3


def drop_published_key(store, target, version, name, drop):
    """Remove a key from a published version's JSON file `name` and fix its manifest entry, as a version
    published by an older pipeline has it."""
    import hashlib

    prefix = layout.drafter_version_prefix(target, version)
    content = json.loads(store.get_bytes(f"{prefix}/{name}"))
    del content[drop]
    data = json.dumps(content, indent=2).encode()
    store.put_bytes(f"{prefix}/{name}", data)
    if name != "manifest.json":
        manifest = json.loads(store.get_bytes(f"{prefix}/manifest.json"))
        entry = next(o for o in manifest["objects"] if o["name"] == name)
        entry.update({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
        store.put_bytes(f"{prefix}/manifest.json", json.dumps(manifest).encode())


def test_a_version_exported_before_vllm_ids_pulls_for_sglang_and_is_refused_for_vllm(
    tmp_path, capsys, caplog, monkeypatch
):
    from pipeline.cli import main
    from pipeline.failures import EXIT_BAD_INPUT

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    store, pull_argv = promoted_kimi_version(tmp_path)
    version = read_alias(store, "kimi-k2.5", "production")["version"]
    drop_published_key(store, "kimi-k2.5", version, "config.json", "eagle_aux_hidden_state_layer_ids")
    dest = tmp_path / "current"
    assert main([*pull_argv, "--dest", str(dest), "--engine", "vllm"]) == EXIT_BAD_INPUT  # no retry fixes it
    assert not dest.exists()
    assert "carries no vLLM aux layer ids" in caplog.text and "Re-export it" in caplog.text
    assert main([*pull_argv, "--dest", str(dest)]) == 0  # SGLang reads eagle_config's ids, which are right
    assert "sglang.launch_server" in capsys.readouterr().out
    assert main(["verify", str(dest)]) == 0
    assert main(["verify", str(dest), "--engine", "vllm"]) == EXIT_BAD_INPUT


def test_drafter_verify_for_vllm_checks_the_vllm_ids(store, tmp_path, capsys, monkeypatch):
    from pipeline.cli import main

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)
    dest = pull(store, "tgt", "production", tmp_path / "served", engine="vllm")
    assert main(["verify", str(dest), "--engine", "vllm"]) == 0
    printed = capsys.readouterr().out
    assert "its vLLM aux layer ids [2, 3, 4] capture the layers it was trained on" in printed
    assert "verified in sglang: load-time checks of SGLang 0.5.23" in printed


BENCHED = {
    "draft_steps": 3,
    "topk": 1,
    "draft_tokens": 4,
    "tau_simulated": 3.4,
    "tau_measured": 3.57,
    "baseline_tok_s": 100.0,
    "drafter_tok_s": 170.0,
    "speedup_vs_baseline": 1.7,
    "speedup_vs_ngram": 1.2,
}


def test_a_version_benchmarked_in_vllm_records_it_beside_sglangs_load_checks(store, tmp_path):
    lineage = {"run_id": "r1", "bench": {**BENCHED, "engine": "vllm", "engine_version": "0.32.0+cpu"}}
    promote(store, "tgt", drafter_dir(tmp_path, 1), lineage, "production", SERVING)
    dest = pull(store, "tgt", "production", tmp_path / "served")
    verified = json.loads((dest / "manifest.json").read_text())["verified_engines"]
    assert set(verified) == {"sglang", "vllm"}
    assert verified["sglang"].startswith(
        "load-time checks of SGLang 0.5.23 (pipeline.engines.sglang_draft_checks)"
    )
    assert verified["sglang"].endswith("; not run")
    assert "benchmarked in vLLM 0.32.0+cpu on the target, 3 draft steps, topk 1" in verified["vllm"]
    assert "measured acceptance length 3.570, 1.70x the target alone" in verified["vllm"]
    assert "not run" not in verified["vllm"]
    card = (dest / "README.md").read_text()
    assert "## Verified engines" in card and f"| vLLM | {verified['vllm']} |" in card
    assert (
        '--speculative-config \'{"method": "eagle3", "model": "<drafter-dir>", "num_speculative_tokens": 3}\''
        in (card)
    )


def test_a_version_benchmarked_by_the_reference_decoder_says_vllm_was_not_run(store, tmp_path):
    # "local": the reference decoder's engine, as lineages written before it was named "reference" hold it
    lineage = {"run_id": "r1", "bench": {**BENCHED, "engine": "local"}}
    version = promote(store, "tgt", drafter_dir(tmp_path, 1), lineage, "production", SERVING)["version"]
    manifest = json.loads(store.get_bytes(f"{layout.drafter_version_prefix('tgt', version)}/manifest.json"))
    verified = manifest["verified_engines"]
    assert set(verified) == {"sglang", "vllm", "reference"}
    assert verified["vllm"] == (
        "config.json gives vLLM the aux layer ids [2, 3, 4], which capture the trained layers [1, 2, 3] "
        "(pipeline.engines.layer_ids); not run"
    )
    assert verified["reference"].startswith("benchmarked with the project's reference decoder, 3 draft steps")


def test_a_vllm_benchmark_with_its_acceptance_checked_says_so(store, tmp_path):
    check = {
        "engine": "vllm",
        "draft_steps": 3,
        "tau": 3.41,
        "reference_tau": 3.4,
        "rel_diff": 0.0029,
        "tolerance": 0.02,
        "passed": True,
        "acceptance_per_position": [0.9, 0.8, 0.71],
        "reference_acceptance_per_position": [0.9, 0.8, 0.7],
    }
    bench = {**BENCHED, "engine": "vllm", "engine_version": "0.32.0", "acceptance": check}
    version = promote(
        store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1", "bench": bench}, "production", SERVING
    )["version"]
    manifest = json.loads(store.get_bytes(f"{layout.drafter_version_prefix('tgt', version)}/manifest.json"))
    vllm = manifest["verified_engines"]["vllm"]
    assert "benchmarked in vLLM 0.32.0 on the target" in vllm and "not run" not in vllm
    assert vllm.endswith(
        "; its acceptance length 3.410 against the reference decoder's 3.400 on the same prompts and chain "
        "(relative difference 0.0029, tolerance 0.02)"
    )


def test_a_lineage_written_when_vllm_served_beside_the_reference_decoder_records_vllm_as_run(store, tmp_path):
    served = {
        "engine": "vllm",
        "engine_version": "0.32.0",
        "draft_steps": 3,
        "tau": 3.41,
        "reference_tau": 3.4,
        "tau_rel_diff": 0.003,
        "acceptance_per_position": [0.9, 0.8, 0.71],
        "reference_acceptance_per_position": [0.9, 0.8, 0.7],
        "baseline_tok_s": 100.0,
        "drafter_tok_s": 140.0,
        "speedup_vs_baseline": {"ratio": 1.4, "ci_low": 1.3, "ci_high": 1.5, "confidence": 0.95, "rounds": 4},
    }
    lineage = {"run_id": "r1", "bench": {**BENCHED, "engine": "local", "real_engine": served}}
    version = promote(store, "tgt", drafter_dir(tmp_path, 1), lineage, "production", SERVING)["version"]
    manifest = json.loads(store.get_bytes(f"{layout.drafter_version_prefix('tgt', version)}/manifest.json"))
    vllm = manifest["verified_engines"]["vllm"]
    assert "not run" not in vllm
    assert vllm.endswith(
        "; served by vLLM 0.32.0 beside the reference decoder, outputs equal to greedy: acceptance length "
        "3.410 (reference decoder 3.400), 1.40x its own baseline"
    )


def test_versions_published_before_verified_engines_still_pull_and_verify(store, tmp_path, capsys):
    from pipeline.cli import main

    version = promote(store, "tgt", drafter_dir(tmp_path, 1), {"run_id": "r1"}, "production", SERVING)[
        "version"
    ]
    drop_published_key(store, "tgt", version, "manifest.json", "verified_engines")
    dest = pull(store, "tgt", "production", tmp_path / "served")
    assert "verified_engines" not in json.loads((dest / "manifest.json").read_text())
    assert main(["verify", str(dest)]) == 0
    assert "verified in sglang: load-time checks of SGLang 0.5.23" in capsys.readouterr().out


def test_a_pinned_pull_takes_a_version_and_refuses_an_alias_or_an_empty_pin(tmp_path, caplog, monkeypatch):
    """`drafter pull --version` is what the serving pods run: a pin that followed `production` would let a
    pod recreated after a promotion serve another version than its replicas."""
    from pipeline.cli import main
    from pipeline.failures import EXIT_FAILED
    from pipeline.ops.registry import resolve

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    store, pull_argv = promoted_kimi_version(tmp_path)
    version = resolve(store, "kimi-k2.5", "production")
    for pin, message in [
        (
            "production",
            f"'production' is an alias of kimi-k2.5, not a version: pin the version it points at ({version})",
        ),
        ("", "no version given (--version is empty)"),
        ("v9999", "kimi-k2.5 has no version named 'v9999'"),
    ]:
        caplog.clear()
        assert main([*pull_argv, "--version", pin, "--dest", str(tmp_path / "refused")]) == EXIT_FAILED
        assert message in caplog.text, pin
        assert not (tmp_path / "refused").exists()
    assert main([*pull_argv, "--version", version, "--dest", str(tmp_path / "pinned")]) == 0
    assert json.loads((tmp_path / "pinned" / "manifest.json").read_text())["version"] == version
