"""One object store for file:// and s3:// roots.

Keys are relative, '/'-separated and validated; nothing is read or written outside the root.
Writes of a single object are atomic on both backends (rename on file://, S3 PUT semantics), and
multi-object artifacts are published data first, manifest last (see pipeline.manifest).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from filelock import FileLock
from pydantic import Field, PositiveInt, field_validator

from pipeline.config_base import Strict, http_url
from pipeline.credentials import refuse_credentials, without_credentials
from pipeline.ids import validate_id, validate_key
from pipeline.retrying import retrying

log = logging.getLogger(__name__)

# where S3 credentials belong (said where a URL that carries some is refused)
S3_CREDENTIALS = (
    "S3 credentials belong in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, the "
    "pod's role) or the deployment's Airflow connection (aws_conn_id)"
)


class StorageConfig(Strict):
    """The run config's `storage:` section: where the store is and how it is reached."""

    root: str = Field(description="file:// path or s3://bucket/prefix; a plain path means file://")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto, ...)")
    region: str | None = None
    multipart_threshold_mb: int = Field(64, ge=5)
    max_attempts: PositiveInt = Field(
        8,
        description="S3 requests: attempts on throttling (503 SlowDown), 5xx, "
        "dropped connections and torn reads (an object whose checksum does not match: 3 reads at most)",
    )
    local_cache: str = Field(".cache/drafter", description="local dir for models, downloads, work dirs")

    def run_workdir(self, run_id: str) -> Path:
        """This machine's scratch directory for one run (drafter copies, training work dirs)."""
        return Path(self.local_cache) / "runs" / validate_id(run_id, "run id")

    @field_validator("root")
    @classmethod
    def _known_scheme(cls, root: str) -> str:
        if "://" in root and not root.startswith(("file://", "s3://")):
            raise ValueError(f"storage.root must be file:// or s3://, got {root!r}")
        return refuse_credentials(root, "storage.root", S3_CREDENTIALS)

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_without_credentials(cls, url: str | None) -> str | None:
        return url if url is None else http_url(url, "storage.endpoint_url", S3_CREDENTIALS)


def _stream_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    return ConnectionClosedError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError


@dataclass(frozen=True)
class S3Credentials:
    """Keys handed to one client (an Airflow connection's, in a process shared with other work, such as the
    triggerer, where they must not go into the environment). Never shown in a repr or a log."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    region: str | None = None


def s3_client(
    endpoint_url: str | None,
    region: str | None,
    max_attempts: int,
    credentials: S3Credentials | None = None,
    **options: Any,
):
    """A boto3 S3 client whose standard retries ride out throttling (503 SlowDown), 5xx and dropped
    connections, with backoff; `options` are more botocore Config settings. Without `credentials`, boto3's
    own chain (environment, profile, pod identity) finds them."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": max_attempts}, **options)
    keys: dict[str, Any] = {}
    if credentials is not None:
        keys = {
            "aws_access_key_id": credentials.access_key_id,
            "aws_secret_access_key": credentials.secret_access_key,
        }
        region = region or credentials.region
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config, **keys)


def _retrying_reads(attempts: int, retry_on: type[BaseException] | tuple[type[BaseException], ...], note):
    """Reads again what botocore's retries do not: a body cut off mid-read, a stale copy after a rewrite."""
    return retrying(attempts, retry_on, first_pause_s=0.2, max_pause_s=5.0, note=note)


_CHUNK = 8 * 1024 * 1024
# S3 reads back what was written (strong read-after-write consistency), so a whole object that does not
# hash to its manifest's checksum is corrupt, or was rewritten while read: it is read twice more, not for
# as long as throttling is retried (max_attempts, up to half a minute of pauses).
CHECKSUM_READS = 3


class StorageError(RuntimeError):
    """An object that is missing, unreadable or outside the store root."""


class ObjectMissingError(StorageError):
    pass


class PreconditionFailed(StorageError):
    """A conditional write lost: the object changed (or appeared) since it was read."""


class ChecksumMismatch(StorageError):
    """The bytes read do not hash to the sha256 their manifest lists."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    bytes: int
    sha256: str


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_write(path: str | Path, durable: bool = True) -> Iterator[Path]:
    """A temporary path beside `path` to write the new file to; when the block ends without an error it is
    flushed to disk (unless not `durable`: a file that need not outlive the machine's uptime) and renamed over
    `path`, so a reader sees the whole old file or the whole new one. An error leaves `path` untouched and
    removes the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.part")
    try:
        yield partial
        if durable:
            fd = os.open(partial, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class ObjectStore(ABC):
    """Interface shared by the file and S3 backends."""

    root_uri: str

    def uri(self, key: str) -> str:
        return f"{self.root_uri.rstrip('/')}/{validate_key(key)}"

    def key_for(self, uri_or_key: str) -> str:
        """The key of a URI inside this root (or a bare key), refusing anything outside it."""
        if "://" not in uri_or_key:
            return validate_key(uri_or_key.strip("/"))
        root = self.root_uri.rstrip("/") + "/"
        if not uri_or_key.startswith(root):
            raise StorageError(f"{uri_or_key} is outside the configured storage root {self.root_uri}")
        return validate_key(uri_or_key[len(root) :].strip("/"))

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo: ...

    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> ObjectInfo: ...

    @abstractmethod
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or bytes [start, end) of it."""

    @abstractmethod
    def get_file(self, key: str, dest: str | Path) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under prefix, sorted. Readers of artifacts use manifests instead; this is for tools."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def prune(self, prefix: str) -> None:  # noqa: B027 (an object store has nothing to do: no folders)
        """Leave nothing behind under `prefix` once it holds no objects: an object store has no folders, so
        nothing to do; FileStore removes the empty folders."""

    @abstractmethod
    def read_with_tag(self, key: str) -> tuple[bytes, str] | None:
        """The object and a tag that changes whenever it is rewritten (its ETag), or None if absent."""

    @abstractmethod
    def put_if(self, key: str, data: bytes, expected_tag: str | None) -> str:
        """Write only if the object still has `expected_tag` (None: only if it does not exist yet).

        Atomic against concurrent writers; raises PreconditionFailed when the condition does not hold.
        Returns the new tag.
        """

    verify_attempts = 1

    def get_verified(self, key: str, sha256: str) -> bytes:
        """The object's bytes if they hash to `sha256`. A mismatch is read again (a stale read after a
        rewrite settles) up to `verify_attempts` times before it is an error."""

        def read() -> bytes:
            data = self.get_bytes(key)
            self._check(key, sha256, hashlib.sha256(data).hexdigest())
            return data

        return self._verifying("reading again")(read)

    def get_file_verified(self, key: str, dest: str | Path, sha256: str) -> None:
        """Download to dest atomically; a checksum mismatch leaves dest untouched."""

        def download(partial: Path) -> None:
            self.get_file(key, partial)
            self._check(key, sha256, sha256_file(partial))

        with atomic_write(dest) as partial:
            self._verifying("downloading again")(download, partial)

    def _check(self, key: str, sha256: str, actual: str) -> None:
        if actual != sha256:
            raise ChecksumMismatch(
                f"checksum mismatch for {self.uri(key)}: manifest {sha256}, object {actual}"
            )

    def _verifying(self, again: str):
        def note(error: BaseException, attempt: int, pause: float) -> None:
            log.warning("%s (attempt %d): %s", error, attempt, again)

        return _retrying_reads(self.verify_attempts, ChecksumMismatch, note)


class FileStore(ObjectStore):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root_uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        path = (self.root / validate_key(key)).resolve()
        if self.root not in path.parents:
            raise StorageError(f"key {key!r} resolves outside the store root")
        return path

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        with atomic_write(self._path(key)) as partial:
            partial.write_bytes(data)
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest())

    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        digest = hashlib.sha256()
        size = 0
        with (
            atomic_write(self._path(key)) as partial,
            open(partial, "wb") as handle,
            open(path, "rb") as source,
        ):
            for block in iter(lambda: source.read(_CHUNK), b""):
                digest.update(block)
                size += len(block)
                handle.write(block)
        return ObjectInfo(key, size, digest.hexdigest())

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as handle:
                if start is None:
                    return handle.read()
                handle.seek(start)
                return handle.read((end - start) if end is not None else -1)
        except FileNotFoundError as err:
            raise ObjectMissingError(f"no object at {self.uri(key)}") from err

    def get_file(self, key: str, dest: str | Path) -> None:
        path = self._path(key)
        if not path.is_file():
            raise ObjectMissingError(f"no object at {self.uri(key)}")
        shutil.copyfile(path, dest)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return []
        keys = [
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        ]
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def prune(self, prefix: str) -> None:
        """The folder of `prefix` and the empty folders in it, if they hold no file (lock files included)."""
        base = self._path(prefix)
        if not base.is_dir() or any(path.is_file() for path in base.rglob("*")):
            return
        for folder in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            folder.rmdir()
        base.rmdir()

    def read_with_tag(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def put_if(self, key: str, data: bytes, expected_tag: str | None) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # writers of one key serialize on a lock file; readers never wait (the rename is atomic)
        with FileLock(path.with_name(f".{path.name}.lock")):
            current = self.read_with_tag(key)
            current_tag = current[1] if current else None
            if current_tag != expected_tag:
                raise PreconditionFailed(f"{self.uri(key)} changed since it was read")
            self.put_bytes(key, data)
        return hashlib.sha256(data).hexdigest()


S3Call = TypeVar("S3Call", bound=Callable[..., Any])


def _reaching_the_endpoint(method: S3Call) -> S3Call:
    """An S3 request that failed for a reason the method does not handle itself fails as a StorageError on
    one line, naming the endpoint, the bucket and what to do, instead of botocore's traceback: an endpoint
    unreachable once its retries ran out, a storage.endpoint_url it cannot use, no credentials
    (NoS3Credentials), or an error the service answered (s3_refusal: no such bucket, access denied, keys
    refused, a 404 from something that is not S3)."""

    @functools.wraps(method)
    def call(self: S3Store, *args: Any, **kwargs: Any) -> Any:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
        from botocore.exceptions import ConnectionError as Unreachable

        endpoint = self.client.meta.endpoint_url
        try:
            return method(self, *args, **kwargs)
        except NoCredentialsError as err:
            raise NoS3Credentials(
                f"no S3 credentials for s3://{self.bucket} at {without_credentials(endpoint)}: set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), give the pod its IAM role, or "
                "name the Airflow connection in the deployment config"
            ) from err
        except ClientError as err:
            raise StorageError(without_credentials(s3_refusal(err, self.bucket, endpoint))) from err
        except Boto3Error as err:  # an upload that failed (S3UploadFailedError says what S3 answered)
            raise StorageError(without_credentials(f"S3 request to {endpoint} failed: {err}")) from err
        except BotoCoreError as err:
            problem = (
                f"cannot reach the S3 endpoint {endpoint} (retried {self.max_attempts} times)"
                if isinstance(err, Unreachable)
                else f"S3 request to {endpoint} failed"
            )
            raise StorageError(without_credentials(f"{problem}: {err}")) from err

    return cast(S3Call, call)


class NoS3Credentials(StorageError):
    """No credentials were found for an S3 request: nothing a retry changes."""


# what each error code S3 answers means to the person who set storage.root and storage.endpoint_url
_S3_ERROR_ADVICE = {
    "NoSuchBucket": "the bucket does not exist there: create it, or correct storage.root",
    "AccessDenied": "the credentials in use may not do this: grant them the bucket's policy, or use others",
    "AllAccessDisabled": "the bucket's access is disabled: ask its owner",
    "InvalidAccessKeyId": "the access key is not one this service knows: check the credentials in use",
    "SignatureDoesNotMatch": "the secret key does not match the access key: check the credentials in use",
    "ExpiredToken": "the session token has expired: renew the credentials",
    "InvalidBucketName": "the bucket name in storage.root is not a valid S3 bucket name",
    "PermanentRedirect": "the bucket lives in another region: set storage.region to it",
    "AuthorizationHeaderMalformed": "the region is wrong for this bucket: set storage.region to the bucket's",
}


def s3_refusal(err: Any, bucket: str, endpoint: str) -> str:
    """One line for an error S3 answered (botocore's ClientError): the operation, the bucket and endpoint,
    the service's code and message, and what to do about it."""
    error = err.response.get("Error", {})
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = str(error.get("Code") or status or "unknown")
    message = " ".join(str(error.get("Message") or "").split())[:200]
    advice = _S3_ERROR_ADVICE.get(code)
    if advice is None and code in {"404", "NotFound"}:
        advice = (
            "the endpoint answered 404 Not Found for the bucket: check that storage.endpoint_url is the S3 "
            "service's address (no path) and that the bucket exists"
        )
    if advice is None and code in {"403", "Forbidden"}:
        advice = "the endpoint answered 403 Forbidden: the credentials in use may not read this bucket"
    said = f"{code}{': ' + message if message else ''}"
    return f"S3 refused {err.operation_name} on s3://{bucket} at {endpoint} ({said})" + (
        f"; {advice}" if advice else ""
    )


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold_mb: int = 64,
        max_attempts: int = 8,
        credentials: S3Credentials | None = None,
    ):
        from boto3.s3.transfer import TransferConfig

        self.bucket = bucket
        self.endpoint_url, self.region = endpoint_url, region
        self.prefix = prefix.strip("/")
        self.root_uri = f"s3://{_join(bucket, self.prefix)}"
        self.max_attempts = max_attempts
        self.verify_attempts = min(max_attempts, CHECKSUM_READS)
        self.client = s3_client(
            endpoint_url, region, max_attempts, credentials, connect_timeout=20, read_timeout=120
        )
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold_mb * 1024 * 1024,
            multipart_chunksize=multipart_threshold_mb * 1024 * 1024,
            num_download_attempts=max_attempts,
        )

    def _key(self, key: str) -> str:
        return _join(self.prefix, validate_key(key))

    @_reaching_the_endpoint
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest())

    @_reaching_the_endpoint
    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        sha = sha256_file(path)
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer)
        return ObjectInfo(key, os.path.getsize(path), sha)

    def _missing(self, err: Exception) -> bool:
        code = getattr(err, "response", {}).get("Error", {}).get("Code", "")
        return code in ("NoSuchKey", "404", "NotFound")

    @_reaching_the_endpoint
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        from botocore.exceptions import ClientError

        kwargs = {}
        if start is not None:
            kwargs["Range"] = f"bytes={start}-" + (str(end - 1) if end is not None else "")

        def read() -> bytes:
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)
            except ClientError as err:
                if self._missing(err):
                    raise ObjectMissingError(f"no object at {self.uri(key)}") from err
                raise
            return response["Body"].read()

        def note(error: BaseException, attempt: int, pause: float) -> None:
            log.warning("reading %s broke off (%s); reading again", self.uri(key), type(error).__name__)

        # botocore retries the request; the connection dropping while the body comes is ours to retry
        try:
            return _retrying_reads(self.max_attempts, _stream_errors(), note)(read)
        except _stream_errors() as err:
            raise StorageError(f"reading {self.uri(key)} failed {self.max_attempts} times: {err}") from err

    @_reaching_the_endpoint
    def get_file(self, key: str, dest: str | Path) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.download_file(self.bucket, self._key(key), str(dest), Config=self.transfer)
        except ClientError as err:
            if self._missing(err):
                raise ObjectMissingError(f"no object at {self.uri(key)}") from err
            raise

    @_reaching_the_endpoint
    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as err:
            if self._missing(err):
                return False
            raise

    def _iter_keys(self, prefix: str) -> Iterator[str]:
        full = _join(self.prefix, prefix)
        full = full + "/" if full else ""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
            for item in page.get("Contents", []):
                yield item["Key"][len(self.prefix) + 1 :] if self.prefix else item["Key"]

    @_reaching_the_endpoint
    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            validate_key(prefix)
        return sorted(self._iter_keys(prefix))

    @_reaching_the_endpoint
    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    @_reaching_the_endpoint
    def read_with_tag(self, key: str) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as err:
            if self._missing(err):
                return None
            raise
        return response["Body"].read(), response["ETag"]

    @_reaching_the_endpoint
    def put_if(self, key: str, data: bytes, expected_tag: str | None) -> str:
        """S3 conditional writes: If-Match on the tag read, or If-None-Match: * for a new object."""
        from botocore.exceptions import ClientError

        condition = {"IfMatch": expected_tag} if expected_tag else {"IfNoneMatch": "*"}
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409") or self._missing(
                err
            ):
                raise PreconditionFailed(f"{self.uri(key)} changed since it was read") from err
            raise
        return response["ETag"]


def open_store(config: StorageConfig, credentials: S3Credentials | None = None) -> ObjectStore:
    """The store rooted at config.root; an S3 store with `credentials` when given, else boto3's own."""
    root = config.root
    if root.startswith("s3://"):
        bucket, _, prefix = root[len("s3://") :].partition("/")
        if len(bucket) < 3:
            raise StorageError(f"invalid S3 bucket in storage.root {root!r}")
        return S3Store(
            bucket,
            prefix,
            config.endpoint_url,
            config.region,
            config.multipart_threshold_mb,
            config.max_attempts,
            credentials,
        )
    path = root[len("file://") :] if root.startswith("file://") else root
    return FileStore(path)
