"""The production rehearsal's own checks (harness/rehearsal.py), without running it: every runbook command
is rehearsed or marked for a real cluster, configs/rehearsal.yaml is Kimi's config in everything but size,
and the engine placement check refuses a pod placed otherwise than its run's engine."""

import fnmatch

import pytest

from tests.conftest import KIMI_CONFIG, REPO

COMMANDS = ("docker ", "kubectl ", "helm ", "aws ", "drafter ", "curl ", "airflow ")


def test_every_runbook_command_is_rehearsed_or_marked_for_a_real_cluster():
    from harness.rehearsal import REAL_CLUSTER, REHEARSED, RUNBOOK, Runbook, runbook_commands

    commands = [
        line.strip()
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("    ") and line.strip().startswith(COMMANDS)
    ]
    assert len(commands) >= 20
    unmarked = [c for c in commands if not c.endswith((REHEARSED, REAL_CLUSTER))]
    assert not unmarked, unmarked
    # the rehearsal has a way to run each [rehearsed] command (it also checks each one ran, in order)
    for command in runbook_commands(REHEARSED):
        assert command.startswith(Runbook.HANDLED), command
    assert any(c.startswith("drafter ") for c in runbook_commands(REHEARSED))


# What configs/rehearsal.yaml may set otherwise than configs/kimi-k2.5.yaml: sizes, counts and the
# thresholds a tiny target can meet, and the CPU's precision. Everything else (engines, storage, how the
# target loads, prompt sources, the rendezvous, launch commands) must be Kimi's.
REHEARSAL_SIZES = {
    "prompts.num_samples",
    "prompts.eval_fraction",
    "prompts.shard_size",
    "prompts.max_prompt_tokens",
    "generate.batch_size",
    "generate.max_new_tokens",
    "generate.sglang.concurrency",
    "generate.sglang.timeout_s",
    "generate.sglang.urls",
    "capture.batch_size",
    "capture.max_length",
    "capture.parity.samples",
    "capture.aux_layer_ids",
    "capture.sglang.concurrency",
    "capture.sglang.timeout_s",
    "capture.sglang.urls",
    "target.hidden_size",
    "target.num_layers",
    "target.vocab_size",
    "target.mla.*",  # the MLA sizes the plan assumes: the tiny target's config.json is at hand in its pods
    "drafter.draft_vocab_size",
    "drafter.head_dim",
    "drafter.intermediate_size",
    "drafter.num_heads",
    "drafter.num_kv_heads",
    "train.attention_chunk",
    "train.checkpoint_every_steps",
    "train.epochs",
    "train.learning_rate",
    "train.log_every",
    "train.max_length",
    "train.micro_batch_size",
    "train.nproc",
    "train.ttt_steps",
    "train.warmup_ratio",
    "train.precision",
    "train.deepspeed_config",  # no bf16 on this CPU
    "train.kubernetes_job",  # its node pods: one CPU rank each, not 8 GPUs
    "evaluate.micro_batch_size",
    "gate.min_cond_acc",
    "gate.min_tau_simulated",
    "gate.max_domain_regression_vs_incumbent",
    "prompts.sources.*.max_samples",  # a few of each standard set
    "benchmark.num_prompts",
    "benchmark.max_new_tokens",
    "benchmark.min_speedup_vs_baseline",
    "benchmark.min_speedup_vs_incumbent",
    "benchmark.min_speedup_vs_ngram",
    "benchmark.sglang.concurrency",
    "benchmark.sglang.max_running_requests",  # the rehearsal's 4 prompts: a replica at capacity runs 4
    "benchmark.batch_sizes",  # the rehearsal's few prompts keep at most 4 requests in flight
    "benchmark.promote_at_batch_sizes",
    "benchmark.sglang.startup_timeout_s",
    "benchmark.sglang.port",
}


def _leaves(node, prefix=""):
    """Every scalar of a config by its dotted path, list items by their index (prompts.sources.2.path)."""
    if isinstance(node, list) and node and all(isinstance(item, dict) for item in node):
        node = dict(enumerate(node))
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {
        key: value
        for name, child in node.items()
        for key, value in _leaves(child, f"{prefix}{name}.").items()
    }


def _a_size(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in REHEARSAL_SIZES)


def test_the_rehearsal_config_is_kimis_in_everything_but_size():
    import yaml

    kimi = _leaves(yaml.safe_load((KIMI_CONFIG).read_text()))
    rehearsal = _leaves(yaml.safe_load((REPO / "configs" / "rehearsal.yaml").read_text()))
    differ = {
        key
        for key in kimi.keys() | rehearsal.keys()
        if not key.startswith("plan.") and kimi.get(key, "absent") != rehearsal.get(key, "absent")
    }
    assert all(_a_size(key) for key in differ), sorted(key for key in differ if not _a_size(key))
    for stage in ("generate", "capture"):  # fewer servers: the first pods of the same StatefulSets
        urls = rehearsal[f"{stage}.sglang.urls"]
        assert urls == kimi[f"{stage}.sglang.urls"][: len(urls)]


class _TaskInstance:
    def __init__(self, task_id: str, result: dict):
        self.task_id, self.result = task_id, result

    def xcom_pull(self, task_ids: str) -> dict:
        assert task_ids == self.task_id
        return self.result


class _Run:
    def __init__(self, dag_id: str, run_id: str, engines: dict[str, str]):
        self.dag_id, self.run_id, self.engines = dag_id, run_id, engines

    def get_task_instances(self) -> list[_TaskInstance]:
        return [_TaskInstance("configure", {"engines": self.engines})]


class _Cluster:
    def __init__(self, rows: list[tuple[str, str, str, str, str]]):
        self.rows = [
            {"pod": f"pod-{n}", "dag_id": dag, "run_id": f"label-{run}", "task_id": task}
            | {"image": image, "node": node}
            for n, (dag, run, task, image, node) in enumerate(rows)
        ]

    def pods_run(self) -> list[dict]:
        return self.rows


def pod_run_label(run_id: str) -> str:
    """A run's pod label, as the cncf provider's make_safe_label_value would make it here."""
    return f"label-{run_id}"


def test_the_engine_placement_check_compares_each_pod_with_its_runs_engine():
    from harness.rehearsal import RehearsalFailed, check_engine_placement
    from pipeline.ops.deployment import load_deployment

    deployment = load_deployment(REPO / "configs" / "deployment" / "kubernetes.yaml")
    images = {name: deployment.kubernetes.images[name] for name in ("pipeline", "sglang", "trainer")}
    http = {"generate": "sglang", "parity": "sglang", "capture": "sglang", "benchmark": "sglang"}
    http["train"] = "torchrun"
    runs = [
        _Run("drafter_data", "manual__1", http),
        _Run("drafter_data", "manual__2", {**http, "parity": "inprocess", "capture": "inprocess"}),
        _Run("drafter_train", "manual__3", http),
        _Run("drafter_train", "manual__4", {**http, "train": "kubernetes"}),
    ]
    stages = {"generate_shard": "generate", "captures": "capture", "benchmark": "benchmark", "train": "train"}
    pods = [
        ("drafter_data", "manual__1", "generate_shard", images["pipeline"], "cpu-node"),
        ("drafter_data", "manual__1", "captures", images["pipeline"], "cpu-node"),
        ("drafter_data", "manual__2", "captures", images["sglang"], "gpu-node-0"),
        ("drafter_train", "manual__3", "benchmark", images["sglang"], "gpu-node-0"),
        ("drafter_train", "manual__3", "train", images["trainer"], "gpu-node-0"),
        ("drafter_train", "manual__4", "train", images["pipeline"], "cpu-node"),  # launches the node Job
        ("drafter_data", "manual__1", "plan", images["pipeline"], "cpu-node"),
    ]
    line = check_engine_placement(
        runs, _Cluster(pods), deployment, lambda dag, task: stages.get(task), pod_run_label
    )
    assert f"capture inprocess: ['{images['sglang']} on gpu-node-0']" in line
    # the in-process run's capture pod in the pipeline image, or on a CPU node: not as its engine places it
    for wrong in ((images["pipeline"], "gpu-node-0"), (images["sglang"], "cpu-node")):
        moved = [*pods[:2], ("drafter_data", "manual__2", "captures", *wrong), *pods[3:]]
        with pytest.raises(RehearsalFailed, match="as the deployment places that engine"):
            check_engine_placement(
                runs, _Cluster(moved), deployment, lambda dag, task: stages.get(task), pod_run_label
            )
    with pytest.raises(RehearsalFailed, match="for each engine placement"):  # no in-process pod ran at all
        check_engine_placement(
            runs, _Cluster(pods[:2] + pods[3:]), deployment, lambda d, t: stages.get(t), pod_run_label
        )
