"""Files a person hands in (a run config, a deployment config, a pulled drafter's manifest, a target's
config.json), read with one error that names the file and says what is wrong with it, and bounded: a file
larger than MAX_USER_FILE_BYTES, or one that is not a regular file (/dev/zero, a FIFO), is refused unread, and
JSON nested deeper than MAX_JSON_DEPTH is refused instead of exhausting the parser's stack."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every file read here is a config or a manifest of a few kilobytes; a model's config.json with a long chat
# template is under 1 MiB. 16 MiB leaves room and bounds what a hostile path can make the tool hold.
MAX_USER_FILE_BYTES = 16 << 20
# The deepest JSON this project writes or reads nests under 10 levels.
MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class UserFile:
    """A file a person handed in, at `location`: `what` it is (named in every error), the `error` raised,
    the name it was given by (`path`, default `location`) and the most bytes it may hold (`limit`)."""

    location: Path
    what: str
    error: type[Exception] = ValueError
    path: str | Path | None = None
    limit: int = MAX_USER_FILE_BYTES

    @property
    def name(self) -> str | Path:
        return self.location if self.path is None else self.path

    def read_bytes(self) -> bytes:
        """Its bytes, at most `limit`: `error` naming it when it is missing, a directory, not a regular
        file, larger than `limit` or unreadable."""
        what, name, error = self.what, self.name, self.error
        try:
            with open(self.location, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise error(
                        f"{what} {name} is not a regular file (a device, FIFO or socket); give a file"
                    )
                raw = handle.read(self.limit + 1)
        except FileNotFoundError as err:
            raise error(f"{what} not found: {name}") from err
        except IsADirectoryError as err:
            raise error(f"{what} {name} is a directory, not a file") from err
        except OSError as err:
            raise error(f"cannot read {what} {name}: {err.strerror or err}") from err
        if len(raw) > self.limit:
            raise error(
                f"{what} {name} is larger than {self.limit >> 20} MiB; no {what} is that large: "
                "check the path"
            )
        return raw

    def read_text(self) -> str:
        """Its UTF-8 text (read_bytes' bounds and errors), or `error` naming it when it is not UTF-8."""
        raw = self.read_bytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.error(
                f"{self.what} {self.name} is not UTF-8 text (byte {err.start} is "
                f"{raw[err.start : err.start + 1]!r}); save it as UTF-8"
            ) from err

    def read_json(self) -> Any:
        """The JSON document it holds, read as read_text and parsed as parse_json."""
        return parse_json(self.read_text(), f"{self.what} {self.name}", self.error)


def json_depth_exceeds(data: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the brackets of the JSON text `data` nest deeper than `limit` (those inside strings are not
    counted), found without parsing it: json.loads would recurse once per level first."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if text.count("[") + text.count("{") <= limit:  # the usual file: too few brackets to nest that deep
        return False
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def parse_json(data: str | bytes, source: str, error: type[Exception] = ValueError) -> Any:
    """The JSON document in `data`: `error` naming `source` (a file or an object's URI) when it is not JSON,
    or nests deeper than MAX_JSON_DEPTH."""
    if json_depth_exceeds(data):
        raise error(
            f"{source} nests its JSON deeper than {MAX_JSON_DEPTH} levels; no file this tool reads does"
        )
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{source} is not valid JSON: {err}") from err
