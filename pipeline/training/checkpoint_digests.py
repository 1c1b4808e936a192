"""What a run's checkpoints held when it committed them, checked before it resumes from one.

DeepSpeed's load_checkpoint unpickles its files (torch.load with weights_only=False), and they lie on a
volume every training node mounts: a file changed or added there after the commit would run as code in every
rank. So the rank that commits a checkpoint records the sha256 of each of its files in the run's object store
(DigestRecords: layout.checkpoint_digests_key, written after the files and before `latest` names the tag), and
a resume first checks the tag `latest` names against the store's record, reading the files as bytes only: a
file that differs, is missing or is not listed, or a checkpoint without a record, is refused, naming it,
before anything is loaded. The record is kept off the volume because whoever can swap a file there can also
rewrite a record beside it; the copy there (DIGESTS_FILE) is for people and is never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline import layout
from pipeline.ids import InvalidIdError, validate_id
from pipeline.storage import ObjectMissingError, ObjectStore, atomic_write, sha256_file

CHECKPOINTS_DIR = "checkpoints"  # in a training attempt's work dir
# {tag: {file path under the tag's directory: sha256}}: a copy for people, not what a resume trusts
DIGESTS_FILE = "committed_sha256.json"
LATEST_FILE = "latest"  # DeepSpeed's pointer to the tag to resume from


class CheckpointRefused(ValueError):
    """A checkpoint that is not what the run committed: resuming from it would unpickle unchecked files."""


@dataclass(frozen=True)
class DigestRecords:
    """Where one training attempt's commits record their digests: the run's object store, which the
    checkpoint volume's users cannot rewrite. `attempt` is the attempt's work dir name (a run's attempts
    use the same tags)."""

    store: ObjectStore
    run_id: str
    attempt: str

    def uri(self, tag: str) -> str:
        return self.store.uri(layout.checkpoint_digests_key(self.run_id, self.attempt, tag))

    def write(self, tag: str, digests: dict[str, str]) -> None:
        # a plain put: a tag is committed again after a kill between this record and `latest`, or when
        # training restarts after its checkpoints were deleted, and the files it then has are the ones
        # to check
        key = layout.checkpoint_digests_key(self.run_id, self.attempt, tag)
        self.store.put_bytes(key, json.dumps(digests, indent=1, sort_keys=True).encode())

    def read(self, tag: str) -> dict[str, str] | None:
        """The digests recorded when `tag` was committed; None when it never was."""
        try:
            raw = self.store.get_bytes(layout.checkpoint_digests_key(self.run_id, self.attempt, tag))
        except ObjectMissingError:
            return None
        try:
            recorded = json.loads(raw)
        except ValueError as err:
            raise CheckpointRefused(
                f"the checkpoint digests {self.uri(tag)} are not JSON ({err}); nothing was loaded"
            ) from err
        if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
            raise CheckpointRefused(
                f"the checkpoint digests {self.uri(tag)} are not a record of files; nothing was loaded"
            )
        return recorded


def checkpoint_files(checkpoint: Path) -> dict[str, Path]:
    """Every file under a checkpoint directory by its path there; a link or anything else that is not a plain
    file is refused (what it points to was never recorded)."""
    if checkpoint.is_symlink() or not checkpoint.is_dir():  # os.walk would follow a link at the top
        raise CheckpointRefused(
            f"checkpoint {checkpoint} is not a plain directory (a link, or missing); nothing was loaded"
        )
    files: dict[str, Path] = {}
    for root, dirs, names in os.walk(checkpoint):
        for name in dirs + names:
            path = Path(root) / name
            where = path.relative_to(checkpoint).as_posix()
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise CheckpointRefused(
                    f"checkpoint {checkpoint}: {where} is not a plain file or directory; nothing was loaded"
                )
            if name in names:
                files[where] = path
    return files


def record_commit(ckpt_dir: Path, tag: str, kept: list[str], records: DigestRecords) -> None:
    """Record the digest of every file of checkpoint `tag` (all ranks' files written: call after
    save_checkpoint's closing barrier) in the run's store, and a copy beside the checkpoints keeping the
    records of the tags in `kept` only."""
    digests = {where: sha256_file(path) for where, path in sorted(checkpoint_files(ckpt_dir / tag).items())}
    records.write(tag, digests)
    try:
        recorded = read_digests(ckpt_dir) or {}
    except CheckpointRefused:  # an unreadable copy: the new checkpoint's replaces it
        recorded = {}
    recorded[tag] = digests
    with atomic_write(ckpt_dir / DIGESTS_FILE) as partial:
        partial.write_text(json.dumps({name: recorded[name] for name in kept if name in recorded}, indent=1))


def read_digests(ckpt_dir: Path) -> dict[str, dict[str, str]] | None:
    path = ckpt_dir / DIGESTS_FILE
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointRefused(
            f"the checkpoint digests {path} are not JSON ({err}); nothing was loaded"
        ) from err
    if not isinstance(recorded, dict):
        raise CheckpointRefused(f"the checkpoint digests {path} are not a record of tags; nothing was loaded")
    return recorded


def resume_point(ckpt_dir: Path, records: DigestRecords) -> str | None:
    """The committed tag to resume from, every file of it checked against the digests the store recorded
    when it was committed (CheckpointRefused, naming the file, when one does not match); None when none was
    committed."""
    latest = ckpt_dir / LATEST_FILE
    if not latest.exists():
        return None
    if ckpt_dir.is_symlink() or latest.is_symlink():
        raise CheckpointRefused(
            f"{latest if latest.is_symlink() else ckpt_dir} is a symbolic link: a checkpoint elsewhere than "
            "this run wrote it; nothing was loaded"
        )
    tag = latest.read_text().strip()
    try:
        validate_id(tag, "checkpoint tag")
    except InvalidIdError as err:
        raise CheckpointRefused(
            f"{latest} names {tag!r}, not a checkpoint of {ckpt_dir}; nothing was loaded"
        ) from err
    recorded = records.read(tag)
    if recorded is None:
        raise CheckpointRefused(
            f"checkpoint {ckpt_dir / tag} has no record of its files at {records.uri(tag)}: this run did "
            "not commit it (it was written before checkpoints were recorded, or by something else), so it "
            "is never loaded; nothing was loaded. To go on, delete the directory "
            f"{ckpt_dir}: the training then restarts from the start of run {records.run_id} (epoch 0, "
            "step 0) and records the checkpoints it writes"
        )
    _require_recorded(ckpt_dir, tag, recorded, records)
    return tag


def copy_verified(checkpoint: Path, dest: Path, recorded: dict[str, str], where: str) -> None:
    """Copy the checkpoint directory to `dest` (made here, 0700, so no other user reaches it), hashing every
    byte as it is copied, and refuse (CheckpointRefused, naming the file; `dest` removed) unless the copy
    holds exactly the recorded files with their recorded sha256. What is then loaded from `dest` is what was
    checked: a file swapped on the shared volume after this read cannot reach the unpickler. Files are
    opened without following links (a link swapped in after checkpoint_files looked is refused too)."""
    found = checkpoint_files(checkpoint)
    problems = [f"{name}: not among the files committed" for name in sorted(found.keys() - recorded.keys())]
    problems += [f"{name}: missing" for name in sorted(recorded.keys() - found.keys())]
    dest.mkdir(mode=0o700, parents=False)
    try:
        for name in sorted(found.keys() & recorded.keys()):
            if _copy_hashing(found[name], dest / name) != recorded[name]:
                problems.append(f"{name}: its sha256 differs from the one recorded at commit")
        if problems:
            raise CheckpointRefused(
                f"checkpoint {checkpoint} is not what the run committed ({where}): "
                + "; ".join(problems)
                + f"; nothing was loaded. Delete the checkpoints directory {checkpoint.parent} to train from "
                "the start"
            )
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _copy_hashing(source: Path, dest: Path) -> str:
    digest = hashlib.sha256()
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as reader, open(dest, "xb") as writer:
        for block in iter(lambda: reader.read(1 << 22), b""):
            digest.update(block)
            writer.write(block)
    return digest.hexdigest()


def _require_recorded(ckpt_dir: Path, tag: str, recorded: dict[str, str], records: DigestRecords) -> None:
    found = checkpoint_files(ckpt_dir / tag)
    problems = [f"{where}: not among the files committed" for where in sorted(found.keys() - recorded.keys())]
    problems += [f"{where}: missing" for where in sorted(recorded.keys() - found.keys())]
    problems += [
        f"{where}: its sha256 differs from the one recorded at commit"
        for where in sorted(found.keys() & recorded.keys())
        if sha256_file(found[where]) != recorded[where]
    ]
    if problems:
        raise CheckpointRefused(
            f"checkpoint {ckpt_dir / tag} is not what the run committed ({records.uri(tag)}): "
            + "; ".join(problems)
            + f"; nothing was loaded. Delete the checkpoints directory {ckpt_dir} to train from the start"
        )
