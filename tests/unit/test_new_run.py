"""`--new-run`: offered only where a fresh run id finds the stage's inputs, and the id it makes is valid."""

from __future__ import annotations

import re

import pytest

from pipeline.cli import build_parser
from pipeline.ids import validate_id
from pipeline.run import new_run_id


def test_a_new_run_id_is_valid_whatever_the_length_of_its_stem():
    for stem in ("r", "a" * 100, "b" * 112, "c" * 113, "d" * 128, "e" * 127 + "."):
        run_id = new_run_id(stem)
        assert validate_id(run_id, "run id") == run_id and len(run_id) <= 128
        assert re.fullmatch(r".+-\d{8}-\d{6}", run_id) and run_id.startswith(stem[:100])
    assert new_run_id("r").startswith("r-") and new_run_id().startswith("run-")


@pytest.mark.parametrize("command", ["run", "prompts"])
def test_new_run_is_offered_where_the_inputs_are_not_the_runs_own(command):
    args = build_parser().parse_args([command, "--config", "c.yaml", "--run-id", "r", "--new-run"])
    assert args.new_run


@pytest.mark.parametrize(
    "command", ["generate", "capture", "dataset", "train", "evaluate", "benchmark", "report"]
)
def test_new_run_is_not_offered_where_the_inputs_default_to_the_runs_own(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--config", "c.yaml", "--run-id", "r", "--new-run"])
    assert "--new-run" in capsys.readouterr().err


def test_a_refused_rerun_suggests_a_new_run_id_with_the_stages_inputs_named():
    from pipeline.cli import new_run_hint

    assert "`drafter evaluate --run-id NEW_RUN_ID --train URI --dataset URI`" in new_run_hint("evaluate")
    assert "`drafter dataset --run-id NEW_RUN_ID --captures URI`" in new_run_hint("dataset")
    assert "--new-run" not in new_run_hint("generate") and "--prompts URI" in new_run_hint("generate")
    assert "`drafter prompts ... --new-run`" in new_run_hint("prompts")
