"""`drafter`: one subcommand per stage, plus `run` for all of them and registry tools.

    drafter <stage> --config configs/local.yaml --run-id RUN [key.path=value ...]

Stage inputs default to the artifacts of the same run id in the configured store, so stages can be
run one by one; explicit --prompts/--dataset/... URIs override that. Each stage prints its output
as one JSON line on stdout. A run id continues only under the config it was made with: a rerun with
another config is refused (pipeline.config_records); `run` and `prompts` take --new-run for a fresh run id
(the other stages a new --run-id with their inputs named).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from pipeline.failures import EXIT_FAILED, EXIT_INCONCLUSIVE, exit_code_for
from pipeline.stages import TABLE


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass


def _setup_logging(verbose: bool) -> None:
    from pipeline.credentials import install_log_masking

    install_log_masking()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "datasets", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _common(parser: argparse.ArgumentParser, run_id: bool = True) -> None:
    parser.add_argument("--config", required=True, help="run config YAML (e.g. configs/local.yaml)")
    if run_id:
        parser.add_argument("--run-id", help="run id (default: a new timestamped id for `run`)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=2")


def _new_run_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--new-run",
        action="store_true",
        help="start a new run under a fresh run id (--run-id with the time appended) instead of continuing "
        "--run-id: a run id continues only under the config it was made with, and a rerun with another "
        "config is refused, naming the settings that differ",
    )


# Where --new-run works: `drafter run` makes every input itself, and prompts reads only the config's sources.
# Every other stage's inputs default to its run id's own artifacts, which a fresh run id does not have.
NEW_RUN_COMMANDS = ("run", "prompts")


def _input_flag(name: str) -> str:
    """`--dataset` for the input `dataset_uri`; `--captures` for `capture_uris`."""
    stem, suffix = name.rsplit("_", 1)
    return f"--{stem}s" if suffix == "uris" else f"--{stem}"


def _input_option(parser: argparse.ArgumentParser, name: str) -> None:
    """`--dataset URI` for the input `dataset_uri`; `--captures URI [URI ...]` for `capture_uris`."""
    if name.endswith("_uris"):
        parser.add_argument(
            _input_flag(name), dest=name, nargs="+", metavar="URI", help="default: this run's"
        )
    else:
        parser.add_argument(_input_flag(name), dest=name, metavar="URI", help="default: this run's")


def new_run_hint(command: str) -> str:
    """How to start `command` as a new run from the command line, for a refused rerun of its run id."""
    if command in NEW_RUN_COMMANDS:
        return f"on the command line, `drafter {command} ... --new-run` starts a new run under a fresh run id"
    reads = next((entry.reads for entry in TABLE if entry.name == command), ())
    inputs = "".join(f" {_input_flag(name)} URI" for name in reads)
    return f"on the command line, `drafter {command} --run-id NEW_RUN_ID{inputs}` starts a new run" + (
        " on the inputs named (they default to the new run id's own artifacts, which it has none of)"
        if inputs
        else ""
    )


_TARGET_CONFIG_HELP = (
    "the target's config.json, or its model directory, to check against: the drafter is refused when the "
    "target's SGLang server would refuse it (context length, RoPE, widths, vocabularies, aux layers, "
    "weights, the version's speculative flags). Default: the target config the drafter recorded at export "
    "(target_config.json)"
)


def counted(most: int):
    """An argparse type: a whole number from 1 to `most` (a count the tool will plan or loop over)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"{value} is not between 1 and {most:,}")
        return value

    return parse


# what `drafter plan` plans for at the most: 5,000 times the mission's 200,000 conversations
MOST_PLANNED_SAMPLES = 1_000_000_000
MOST_SHOWN_RUNS = 10_000


def _engine_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--engine", choices=("sglang", "vllm"), default="sglang", help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drafter", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run every stage for a config and print a summary table")
    _common(p)
    _new_run_option(p)
    for entry in TABLE:
        p = sub.add_parser(entry.name, help=entry.help)
        _common(p)
        if entry.name in NEW_RUN_COMMANDS:
            _new_run_option(p)
        for name in entry.reads:
            _input_option(p, name)
    p = sub.add_parser("pull", help="download a drafter version, verified, into a directory")
    _common(p, run_id=False)
    p.add_argument("--target", help="target name (default: the config's)")
    pulled = p.add_mutually_exclusive_group()
    pulled.add_argument("--alias", default="production", help="alias or version")
    pulled.add_argument(
        "--version",
        help="exactly this version, an alias name refused: what a serving pod pins, so a pod recreated "
        "after a later promotion (a drain, an eviction) serves what its replicas serve",
    )
    p.add_argument("--dest", required=True)
    _engine_option(p, "the engine whose serving command to print (vllm: the version must carry vLLM's ids)")
    p.add_argument(
        "--flags-file",
        help="also write the engine's flags that serve the target with this version (one line after the "
        "target's path: sglang: --tp, --trust-remote-code when the target needs it, the speculative flags; "
        "vllm: --tensor-parallel-size, --trust-remote-code, --speculative-config), for a server started "
        "from it: `launch_server --model-path TARGET $(cat FILE)` or `vllm serve TARGET $(cat FILE)`",
    )
    p.add_argument("--target-config", metavar="DIR_OR_CONFIG_JSON", help=_TARGET_CONFIG_HELP)
    p = sub.add_parser("rollback", help="point production back at previous")
    _common(p, run_id=False)
    p = sub.add_parser("list", help="list drafter versions and aliases")
    _common(p, run_id=False)
    p = sub.add_parser(
        "verify",
        help="verify a drafter directory against its manifest.json, and that the target's SGLang server "
        "would serve it",
    )
    p.add_argument("directory")
    p.add_argument("--target-config", metavar="DIR_OR_CONFIG_JSON", help=_TARGET_CONFIG_HELP)
    _engine_option(p, "vllm: also check the drafter carries vLLM's aux layer ids, consistent with SGLang's")
    p = sub.add_parser("status", help="the registry's aliases and recent runs with their gate/bench outcomes")
    _common(p, run_id=False)
    p.add_argument("--limit", type=counted(MOST_SHOWN_RUNS), default=10, help="how many recent runs to show")
    p = sub.add_parser(
        "watches",
        help="poll the deployment's retraining watches once, as the triggerer does, firing nothing: run it "
        "where the triggerer runs, to check its mounts and identity",
    )
    p.add_argument("--deployment", metavar="FILE", help="default: $DRAFTER_DEPLOYMENT, else the local one")
    p = sub.add_parser("plan", help="capacity plan: storage, GPU-hours, wall time and S3 cost for N samples")
    p.add_argument("--config", required=True)
    p.add_argument(
        "--samples",
        type=counted(MOST_PLANNED_SAMPLES),
        required=True,
        help="conversations to generate and capture",
    )
    p.add_argument(
        "--generate-servers", type=int, help="SGLang generation servers (default: generate.sglang.urls)"
    )
    p.add_argument(
        "--capture-servers", type=int, help="SGLang capture servers (default: capture.sglang.urls)"
    )
    p.add_argument(
        "--train-nodes",
        type=int,
        help="training nodes (default: train.nodes when above 1, else plan.train_nodes)",
    )
    p.add_argument(
        "--measured-from",
        metavar="RUN_ID",
        help="take token counts and rates measured by this finished run (a pilot) over the config's",
    )
    p.add_argument(
        "--transport",
        metavar="FILE",
        help="transport and client rates measured by benchmarks/bench_capture_transport.py --json FILE",
    )
    p.add_argument(
        "--deployment",
        metavar="FILE",
        help="check the plan against this deployment config's limits (the train task's timeout, the DAGs' "
        "deadlines); exit 1 when one is too short",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. plan.gpu_hour_usd=3.2")
    p = sub.add_parser("train-worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", required=True)
    # a rank of an in-process capture job (pipeline.engines.inprocess.launch_rank_job starts them)
    p = sub.add_parser("capture-rank", help=argparse.SUPPRESS)
    _common(p)
    p.add_argument("--responses", required=True)
    p.add_argument("--snapshot", help="the capture's snapshot (capture)")
    p.add_argument("--shard", help="one response shard (a mapped task); default: every shard, then publish")
    p.add_argument("--parity-report", help="only check the engine (parity); rank 0 writes the report")
    return parser


def _load(args):
    from pipeline.config import load_config

    return load_config(args.config, args.overrides)


def _require_run_id(args) -> str:
    if getattr(args, "new_run", False):
        return _new_run_id(args)
    if not args.run_id:
        raise SystemExit("this stage needs --run-id")
    return args.run_id


def _new_run_id(args) -> str:
    """--new-run's fresh run id, told on stderr (stdout carries the stage's output)."""
    from pipeline.run import new_run_id

    run_id = new_run_id(args.run_id)
    logging.getLogger("drafter").info("a new run: run id %s", run_id)
    return run_id


def dispatch(args) -> int:
    from pipeline.ops import registry
    from pipeline.storage import open_store

    if args.command == "train-worker":
        from pipeline.training.worker import worker_main

        worker_main(args.spec)
        return 0
    if args.command == "verify":
        return _verify(args)
    if args.command == "watches":
        return _watches(args)
    config = _load(args)
    if args.command == "capture-rank":
        return _capture_rank(args, config)
    if args.command == "plan":
        return _plan(args, config)
    store = open_store(config.storage)
    target = getattr(args, "target", None) or config.target.name
    if args.command == "run":
        from pipeline.run import format_table, new_run_id, run_all

        run_id = _new_run_id(args) if args.new_run else args.run_id or new_run_id()
        result = run_all(config, run_id, store)
        print(format_table(result.summary))
        if result.stop is not None:
            log_failure(args.command, result.stop, result.exit_code())
        print(f"report={result.summary.report}")
        print(f"summary={result.location}")
        return result.exit_code()
    if args.command == "pull":
        return _pull(args, config, store, target)
    if args.command == "rollback":
        record = registry.rollback(store, target)
        print(json.dumps(record))
        return 0
    if args.command == "status":
        from pipeline.ops.report import status_table

        print(status_table(store, target, args.limit))
        return 0
    if args.command == "list":
        aliases = {
            a: (registry.read_alias(store, target, a) or {}).get("version") for a in registry.SHOWN_ALIASES
        }
        print(
            json.dumps(
                {"target": target, "aliases": aliases, "versions": registry.list_versions(store, target)},
                indent=2,
            )
        )
        return 0
    return _stage(args, config)


def _watches(args) -> int:
    from pipeline.ops.deployment import load_deployment
    from pipeline.ops.watch import survey

    deployment = load_deployment(args.deployment)
    for line in survey(deployment.watch, deployment.run_config):
        print(line)
    return 0


def _verify(args) -> int:
    from pipeline.drafter.export import no_engine_here, written_layer_ids
    from pipeline.drafter.servable import target_config_for
    from pipeline.ops import registry

    manifest = registry.verify_dir(args.directory, args.target_config, args.engine)
    checked = target_config_for(Path(args.directory), args.target_config)
    matches = (
        f"ok: {args.directory} matches its manifest ({len(manifest['objects'])} files, "
        f"{manifest.get('target')} version {manifest.get('version')})"
    )
    if args.engine == "sglang":
        print(f"{matches} and SGLang would serve it for the target of {checked}")
    else:
        config = json.loads((Path(args.directory) / "config.json").read_text())
        print(
            f"{matches}, fits the target of {checked} (SGLang's load-time checks, without SGLang's flags), "
            f"and its vLLM aux layer ids {written_layer_ids(config, 'vllm')} capture the layers it was "
            "trained on, as SGLang's do"
        )
    for engine, how in registry.manifest_verified_engines(manifest).items():
        print(f"verified in {engine}: {how}")
    unloadable = no_engine_here(json.loads((Path(args.directory) / "config.json").read_text()))
    if unloadable is not None:
        print(unloadable)
    return 0


def _pull(args, config, store, target: str) -> int:
    from pipeline.drafter.servable import given_target_config
    from pipeline.ops import registry

    if args.target_config:  # a mistake in it is bad input, told before anything is downloaded
        given_target_config(args.target_config)
    pulled = args.alias if args.version is None else registry.pinned_version(store, target, args.version)
    dest = registry.pull(store, target, pulled, args.dest, args.target_config, args.engine)
    manifest = json.loads((dest / "manifest.json").read_text())
    serving = manifest["serving"]
    configured = config.benchmark.sglang.max_running_requests if config.benchmark.sglang else None
    if args.engine == "sglang" and "max_running_requests" not in serving and configured is not None:
        serving = {**serving, "max_running_requests": configured}
        print(
            f"note: {manifest['version']} records no max_running_requests (benchmarked before the benchmark "
            f"set it); serving at the config's benchmark.sglang.max_running_requests {configured}",
            file=sys.stderr,
        )
    command = registry.engine_launch_command(args.engine, config.target, str(dest), serving)
    print(f"pulled {target} {manifest['version']} into {dest}")
    if args.engine == "vllm" and registry.chain_note(serving):
        print(f"note: {registry.chain_note(serving)}", file=sys.stderr)
    print("serve with: " + shlex.join(command))
    if args.flags_file:
        flags = registry.engine_server_flags(args.engine, config.target, str(dest), serving)
        registry.write_serving_flags(args.flags_file, flags)
    return 0


def _capture_rank(args, config) -> int:
    from pipeline.stages import capture, parity
    from pipeline.storage import open_store

    store = open_store(config.storage)
    if args.parity_report:
        from pipeline.engines.inprocess import rank_and_world

        report = parity.check_engine(config, store, args.responses)
        if rank_and_world()[0] == 0:
            Path(args.parity_report).write_text(json.dumps(report))
        return 0
    if not args.snapshot:
        raise SystemExit("capture-rank needs --snapshot (or --parity-report)")
    if args.shard:
        capture.run_shard(config, args.responses, args.snapshot, args.shard, store)
    else:
        inputs = capture.Inputs(responses_uri=args.responses, snapshot=args.snapshot)
        capture.run(config, inputs, _require_run_id(args), store)
    return 0


def _plan(args, config) -> int:
    from pipeline.ops.capacity import PlanError, format_plan, measured_rates, plan, transport_rates
    from pipeline.user_files import UserFile

    measured = measured_rates(config, args.measured_from) if args.measured_from else None
    transport = None
    if args.transport:
        figures = UserFile(Path(args.transport), "transport figures", PlanError).read_json()
        transport = transport_rates(figures, config, args.transport)
    report = plan(
        config,
        args.samples,
        args.generate_servers,
        args.capture_servers,
        args.train_nodes,
        measured,
        transport,
    )
    checks = None
    if args.deployment:
        from pipeline.ops.deployment import load_deployment
        from pipeline.ops.plan_fit import deployment_fit, format_fit

        limits = load_deployment(args.deployment).plan_limits()
        checks = deployment_fit(report, limits, config.prompts.shard_size)
        report["deployment_fit"] = checks
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    if checks is not None and not args.json:
        print(format_fit(checks, args.deployment))
    return 0 if checks is None or all(check["fits"] for check in checks) else 1


def _stage(args, config) -> int:
    from pipeline.run import local_rates
    from pipeline.stages import run_stage
    from pipeline.storage import open_store

    run_id = _require_run_id(args)
    entry = next(entry for entry in TABLE if entry.name == args.command)
    inputs = {name: value for name in entry.reads if (value := getattr(args, name)) is not None}
    store = open_store(config.storage)
    output = run_stage(args.command, config, run_id, store, rates=local_rates(config), **inputs)
    print(json.dumps(output.model_dump()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    _setup_logging(args.verbose)
    try:
        return dispatch(args)
    except Exception as failure:
        code = exit_code_for(failure)
        if code == EXIT_FAILED and not isinstance(failure, RuntimeError):
            return _defect(args, failure)
        log_failure(args.command, failure, code)
        return code


def _defect(args, failure: Exception) -> int:
    """A failure the table does not know, which is a defect in this tool: one line saying so (the traceback
    with --verbose), never a traceback at a user."""
    logger = logging.getLogger("drafter")
    if args.verbose:
        logger.exception("drafter %s failed on a defect", args.command)
    logger.error(
        "drafter %s failed on a defect in this tool (%s: %s); rerun with --verbose for its traceback, and "
        "report it",
        args.command,
        type(failure).__name__,
        str(failure)[:300],
    )
    return EXIT_FAILED


def plainly_told() -> tuple[type[BaseException], ...]:
    """Failures whose message says all there is (no type name before it)."""
    from pipeline.config import ConfigError
    from pipeline.data.capture_contract import ContractMismatch
    from pipeline.ids import InvalidIdError
    from pipeline.promotion import GateFailed, PromotionRefused

    return GateFailed, PromotionRefused, ConfigError, InvalidIdError, ContractMismatch


def log_failure(command: str, failure: BaseException, code: int) -> None:
    """What stopped the command, at the level its exit code calls for: an inconclusive benchmark is an
    outcome, not an error; a rerun under another config says how to start anew."""
    from pipeline.config_records import ConfigChanged

    logger = logging.getLogger("drafter")
    if code == EXIT_INCONCLUSIVE:
        logger.warning("%s", failure)
    elif isinstance(failure, ConfigChanged):
        logger.error("%s; %s", failure, new_run_hint(command))
    elif isinstance(failure, plainly_told()):
        logger.error("%s", failure)
    else:
        logger.error("%s: %s", type(failure).__name__, failure)


if __name__ == "__main__":
    sys.exit(main())
