"""pipeline.training.checkpoint_digests: a resume reads only a checkpoint whose files are what the run
committed, every file checked as bytes against the digests recorded at commit, before any is unpickled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.storage import FileStore, sha256_file
from pipeline.training.checkpoint_digests import (
    DIGESTS_FILE,
    CheckpointRefused,
    DigestRecords,
    read_digests,
    record_commit,
    resume_point,
)
from pipeline.training.worker import rank_0_verdict

ATTEMPT = "train-0123abcd"


@pytest.fixture
def records(tmp_path) -> DigestRecords:
    """The run's object store, where a commit records its digests (not on the checkpoint volume)."""
    return DigestRecords(FileStore(tmp_path / "store"), "run-1", ATTEMPT)


def store_record(records: DigestRecords, tag: str) -> Path:
    return Path(records.store.root) / layout.checkpoint_digests_key("run-1", ATTEMPT, tag)


def committed(ckpt_dir: Path, tag: str, kept: list[str], records: DigestRecords) -> Path:
    """A checkpoint as DeepSpeed leaves it (a model file, one optimizer file per rank), committed."""
    checkpoint = ckpt_dir / tag
    checkpoint.mkdir(parents=True)
    (checkpoint / "mp_rank_00_model_states.pt").write_bytes(b"model " + tag.encode())
    for rank in range(2):
        (checkpoint / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"optim %d" % rank)
    record_commit(ckpt_dir, tag, kept, records)
    (ckpt_dir / "latest").write_text(tag)
    return checkpoint


def test_the_committed_checkpoint_is_the_resume_point(tmp_path, records):
    ckpt_dir = tmp_path / "checkpoints"
    assert resume_point(ckpt_dir, records) is None  # nothing committed: train from the start
    committed(ckpt_dir, "step-1", ["step-1"], records)
    committed(ckpt_dir, "step-2", ["step-1", "step-2"], records)
    committed(ckpt_dir, "step-3", ["step-2", "step-3"], records)
    assert resume_point(ckpt_dir, records) == "step-3"
    assert sorted(read_digests(ckpt_dir) or {}) == ["step-2", "step-3"]  # pruned with the checkpoints
    assert sorted(json.loads((ckpt_dir / DIGESTS_FILE).read_text())["step-3"]) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    # the store holds the same record, the one a resume trusts
    assert (
        json.loads(store_record(records, "step-3").read_text())
        == json.loads((ckpt_dir / DIGESTS_FILE).read_text())["step-3"]
    )


def test_a_tag_committed_again_replaces_its_record(tmp_path, records):
    """A kill between the record and `latest`, or a restart after the checkpoints were deleted, commits a
    tag again, with other bytes: its new record is the one checked."""
    ckpt_dir = tmp_path / "checkpoints"
    checkpoint = committed(ckpt_dir, "step-1", ["step-1"], records)
    (checkpoint / "mp_rank_00_model_states.pt").write_bytes(b"model written again")
    record_commit(ckpt_dir, "step-1", ["step-1"], records)
    assert resume_point(ckpt_dir, records) == "step-1"


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
        (lambda c: (c.parent / "latest").write_text("../elsewhere"), "../elsewhere"),
    ],
)
def test_a_checkpoint_that_is_not_what_was_committed_is_refused_naming_what(tmp_path, records, damage, named):
    checkpoint = committed(tmp_path / "checkpoints", "step-1", ["step-1"], records)
    damage(checkpoint)
    with pytest.raises(CheckpointRefused, match="nothing was loaded") as refused:
        resume_point(checkpoint.parent, records)
    assert named in str(refused.value)


def forge_local_digests(checkpoint: Path, name: str, data: bytes) -> None:
    """Swap a checkpoint file and rewrite the digests file beside it to match: all the volume allows."""
    (checkpoint / name).write_bytes(data)
    local = checkpoint.parent / DIGESTS_FILE
    recorded = json.loads(local.read_text())
    recorded[checkpoint.name][name] = sha256_file(checkpoint / name)
    local.write_text(json.dumps(recorded))


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt"])
def test_a_forged_digests_file_on_the_volume_does_not_vouch_for_a_swapped_file(tmp_path, records, name):
    checkpoint = committed(tmp_path / "checkpoints", "step-1", ["step-1"], records)
    forge_local_digests(checkpoint, name, b"a pickle that runs code")
    with pytest.raises(CheckpointRefused, match="nothing was loaded") as refused:
        resume_point(checkpoint.parent, records)
    assert name in str(refused.value)


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda path: path.write_text("not json"), "not JSON"),
        (lambda path: path.write_text("[1]"), "not a record of files"),
    ],
)
def test_a_damaged_record_in_the_store_is_refused_naming_it(tmp_path, records, damage, named):
    checkpoint = committed(tmp_path / "checkpoints", "step-1", ["step-1"], records)
    damage(store_record(records, "step-1"))
    with pytest.raises(CheckpointRefused, match="nothing was loaded") as refused:
        resume_point(checkpoint.parent, records)
    assert named in str(refused.value) and records.uri("step-1") in str(refused.value)


def test_a_checkpoint_without_a_record_says_which_directory_to_delete(tmp_path, records):
    """A checkpoint written before digests were recorded (or by another run): no record in the store.
    It is never adopted; the refusal says how to go on, and what that costs."""
    checkpoint = committed(tmp_path / "checkpoints", "step-1", ["step-1"], records)
    store_record(records, "step-1").unlink()  # the local digests file still lists it: not trusted
    with pytest.raises(CheckpointRefused, match="nothing was loaded") as refused:
        resume_point(checkpoint.parent, records)
    message = str(refused.value)
    assert records.uri("step-1") in message
    assert f"delete the directory {checkpoint.parent}" in message
    assert "restarts from the start of run run-1" in message


def test_rank_0_turns_any_failure_of_its_check_into_a_refusal_every_rank_hears(tmp_path, records):
    """Rank 0 must broadcast a verdict whatever goes wrong while it checks (an OSError reading `latest` or
    hashing a file), else the other ranks wait in the broadcast until the collective timeout."""
    ckpt_dir = tmp_path / "checkpoints"
    (ckpt_dir / "latest").mkdir(parents=True)  # reading it raises IsADirectoryError, an OSError
    verdict, tag, error = rank_0_verdict(ckpt_dir, records)
    assert (verdict, tag) == (2, "") and isinstance(error, IsADirectoryError)
    committed(tmp_path / "good", "step-1", ["step-1"], records)
    assert rank_0_verdict(tmp_path / "good", records) == (1, "step-1", None)
    assert rank_0_verdict(tmp_path / "none", records) == (0, "", None)
