"""pipeline.training.checkpoint_digests: a resume reads only a checkpoint whose files are what the run
committed, every file checked as bytes against the digests recorded at commit, before any is unpickled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.training.checkpoint_digests import (
    DIGESTS_FILE,
    CheckpointRefused,
    read_digests,
    record_commit,
    resume_point,
)


def committed(ckpt_dir: Path, tag: str, kept: list[str]) -> Path:
    """A checkpoint as DeepSpeed leaves it (a model file, one optimizer file per rank), committed."""
    checkpoint = ckpt_dir / tag
    checkpoint.mkdir(parents=True)
    (checkpoint / "mp_rank_00_model_states.pt").write_bytes(b"model " + tag.encode())
    for rank in range(2):
        (checkpoint / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"optim %d" % rank)
    record_commit(ckpt_dir, tag, kept)
    (ckpt_dir / "latest").write_text(tag)
    return checkpoint


def test_the_committed_checkpoint_is_the_resume_point(tmp_path):
    assert resume_point(tmp_path) is None  # nothing committed: train from the start
    committed(tmp_path, "step-1", ["step-1"])
    committed(tmp_path, "step-2", ["step-1", "step-2"])
    committed(tmp_path, "step-3", ["step-2", "step-3"])
    assert resume_point(tmp_path) == "step-3"
    assert sorted(read_digests(tmp_path) or {}) == ["step-2", "step-3"]  # pruned with the checkpoints
    assert sorted(json.loads((tmp_path / DIGESTS_FILE).read_text())["step-3"]) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


@pytest.mark.parametrize(
    "damage, named",
    [
        (
            lambda c: (c / "mp_rank_00_model_states.pt").write_bytes(b"model step-X"),
            "mp_rank_00_model_states.pt",
        ),
        (lambda c: (c / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"x"), "zero_pp_rank_2"),
        (lambda c: (c / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(), "zero_pp_rank_1_mp_rank_00"),
        (
            lambda c: (c / "nested").mkdir() or (c / "nested" / "extra.pt").write_bytes(b"x"),
            "nested/extra.pt",
        ),
        (lambda c: (c / "link.pt").symlink_to(c / "mp_rank_00_model_states.pt"), "link.pt"),
        (lambda c: (c.parent / DIGESTS_FILE).unlink(), DIGESTS_FILE),
        (lambda c: (c.parent / DIGESTS_FILE).write_text("{}"), DIGESTS_FILE),
        (lambda c: (c.parent / DIGESTS_FILE).write_text("not json"), DIGESTS_FILE),
        (lambda c: (c.parent / "latest").write_text("../elsewhere"), "../elsewhere"),
    ],
)
def test_a_checkpoint_that_is_not_what_was_committed_is_refused_naming_what(tmp_path, damage, named):
    checkpoint = committed(tmp_path, "step-1", ["step-1"])
    damage(checkpoint)
    with pytest.raises(CheckpointRefused, match="nothing was loaded") as refused:
        resume_point(tmp_path)
    assert named in str(refused.value)
