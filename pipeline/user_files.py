"""Files a person hands in (a run config, a deployment config, a pulled drafter's manifest), read with one
error that names the file and says what is wrong with it."""

from __future__ import annotations

from pathlib import Path


def read_text(
    location: Path, what: str, error: type[Exception] = ValueError, path: str | Path | None = None
) -> str:
    """The UTF-8 text of the file at `location`: `error` naming it (as `what` and `path`, the name it was
    given by, default `location`) when it is missing, a directory, unreadable or not UTF-8 text."""
    path = location if path is None else path
    try:
        raw = location.read_bytes()
    except FileNotFoundError as err:
        raise error(f"{what} not found: {path}") from err
    except IsADirectoryError as err:
        raise error(f"{what} {path} is a directory, not a file") from err
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from err
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(
            f"{what} {path} is not UTF-8 text (byte {err.start} is {raw[err.start : err.start + 1]!r}); "
            "save it as UTF-8"
        ) from err
