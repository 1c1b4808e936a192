"""The local cluster's Kubernetes API server, for clients inside its pods.

A pod calls it as a pod calls a real cluster's API server: `https://$KUBERNETES_SERVICE_HOST:
$KUBERNETES_SERVICE_PORT`, its service account's bearer token and the cluster CA from
/var/run/secrets/kubernetes.io/serviceaccount. The server listens on 127.0.0.1 only, over TLS with a
certificate made when it starts (SAN IP 127.0.0.1 and DNS kubernetes.default.svc; the certificate is its
own CA, the pods' ca.crt). A request is authenticated by its token (401 without a known one) and
authorized by the Roles, ClusterRoles and RoleBindings applied to the cluster: default deny, only a
binding in the request's namespace grants anything (403). Refusals are Kubernetes Status objects with
its codes, reasons and messages.

Served (ROUTES: another resource is a route and a handler more):
- GET    /apis/apps/v1/namespaces/{namespace}/statefulsets/{name}
- GET    /apis/apps/v1/namespaces/{namespace}/statefulsets/{name}/scale
- PATCH  /apis/apps/v1/namespaces/{namespace}/statefulsets/{name}/scale  (application/merge-patch+json)
- POST   /apis/batch/v1/namespaces/{namespace}/jobs  (201 Created; 409 AlreadyExists; 422 for a Job the local
         controller does not run: harness.cluster.LocalCluster.create_job)
- GET    /apis/batch/v1/namespaces/{namespace}/jobs/{name}  (with its status)
- PATCH  /apis/batch/v1/namespaces/{namespace}/jobs/{name}  (application/merge-patch+json of
         metadata.ownerReferences only: another field is refused, 422, as the local Job controller would not
         act on it)
- DELETE /apis/batch/v1/namespaces/{namespace}/jobs/{name}  (DeleteOptions: propagationPolicy Background or
         Foreground deletes its pods with it; Orphan, a Job's default, leaves them running)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import logging
import re
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from harness.json_http import send_json

log = logging.getLogger(__name__)

VERBS = {"GET": "get", "PATCH": "patch", "POST": "create", "PUT": "update", "DELETE": "delete"}
MERGE_PATCH = "application/merge-patch+json"
User = tuple[str, str]  # (namespace, service account)


class ClusterError(RuntimeError):
    """A pod spec or manifest the local cluster cannot run as stated."""


class ClusterJob(Protocol):
    manifest: dict[str, Any]

    def status(self) -> dict[str, Any]: ...


class ClusterState(Protocol):
    """What the API server reads and changes of the cluster it serves (harness.cluster.LocalCluster): this
    module is below the cluster, which starts the server with itself."""

    namespaces: set[str]
    statefulsets: dict[tuple[str, str], dict[str, Any]]
    rbac: Rbac

    @property
    def jobs(self) -> Mapping[tuple[str, str], ClusterJob]: ...

    def authenticate(self, token: str) -> User | None: ...

    def scale_statefulset(self, namespace: str, name: str, replicas: int) -> None: ...

    def statefulset_status(self, namespace: str, name: str) -> dict[str, int]: ...

    def create_job(self, manifest: dict[str, Any]) -> ClusterJob | None: ...

    def delete_job(self, namespace: str, name: str, with_pods: bool) -> ClusterJob | None: ...

    def patch_job_owners(
        self, namespace: str, name: str, owners: list[dict[str, Any]] | None
    ) -> ClusterJob: ...


class ApiError(Exception):
    """A request the API server refuses, answered as a Kubernetes Status."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


@dataclass(frozen=True)
class Request:
    namespace: str
    name: str  # "" for a request on the collection (a create)
    body: bytes
    content_type: str

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"error decoding the request body: {err}") from None


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    group: str
    resource: str  # with its subresource: "statefulsets/scale"
    handler: Callable[[ClusterState, Request], dict[str, Any]]
    success: int = 200

    def qualified(self, name: str) -> str:
        """How Kubernetes names the object in messages: `statefulsets.apps "sglang-generate"` (the resource
        alone for the collection)."""
        plural = self.resource.split("/")[0]
        kind = f"{plural}.{self.group}" if self.group else plural
        return f'{kind} "{name}"' if name else kind


def _collection_path(group: str, version: str, plural: str) -> str:
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    return rf"{prefix}/namespaces/(?P<namespace>[a-z0-9.-]+)/{plural}"


def _object_path(group: str, version: str, plural: str, subresource: str = "") -> re.Pattern[str]:
    suffix = f"/{subresource}" if subresource else ""
    return re.compile(rf"{_collection_path(group, version, plural)}/(?P<name>[a-z0-9.-]+){suffix}")


# -- RBAC -------------------------------------------------------------------------------------------
class Rbac:
    """The Roles, ClusterRoles and RoleBindings applied to the cluster, and what they allow."""

    def __init__(self) -> None:
        self.rules: dict[tuple[str, str, str], list[dict[str, Any]]] = {}  # (kind, namespace or "", name)
        self.bindings: dict[tuple[str, str], dict[str, Any]] = {}

    def record(self, doc: dict[str, Any]) -> None:
        kind, meta = doc["kind"], doc["metadata"]
        namespace = meta.get("namespace", "default")
        if kind == "RoleBinding":
            self.bindings[(namespace, meta["name"])] = doc
        else:
            self.rules[(kind, namespace if kind == "Role" else "", meta["name"])] = doc.get("rules") or []

    def allows(self, user: User, verb: str, group: str, resource: str, namespace: str, name: str) -> bool:
        for (bound_in, _), binding in list(self.bindings.items()):
            if bound_in != namespace or not any(
                _is_user(subject, user, bound_in) for subject in binding.get("subjects") or []
            ):
                continue
            ref = binding["roleRef"]
            rules = self.rules.get((ref["kind"], namespace if ref["kind"] == "Role" else "", ref["name"]), [])
            if any(_grants(rule, verb, group, resource, name) for rule in rules):
                return True
        return False


def _is_user(subject: dict[str, Any], user: User, binding_namespace: str) -> bool:
    return (
        subject.get("kind") == "ServiceAccount"
        and subject.get("name") == user[1]
        and subject.get("namespace", binding_namespace) == user[0]
    )


def _grants(rule: dict[str, Any], verb: str, group: str, resource: str, name: str) -> bool:
    def covers(key: str, wanted: str) -> bool:
        values = rule.get(key) or []
        return "*" in values or wanted in values

    return (
        covers("verbs", verb)
        and covers("apiGroups", group)
        and covers("resources", resource)
        and (not rule.get("resourceNames") or name in rule["resourceNames"])
    )


# -- StatefulSets -----------------------------------------------------------------------------------
def _statefulset(cluster: ClusterState, request: Request) -> dict[str, Any]:
    statefulset = cluster.statefulsets.get((request.namespace, request.name))
    if statefulset is None:
        raise ApiError(404, "NotFound", f'statefulsets.apps "{request.name}" not found')
    return statefulset


def read_scale(cluster: ClusterState, request: Request) -> dict[str, Any]:
    statefulset = _statefulset(cluster, request)
    labels = (statefulset["spec"].get("selector") or {}).get("matchLabels") or {}
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {"name": request.name, "namespace": request.namespace},
        "spec": {"replicas": statefulset["spec"].get("replicas", 1)},
        "status": {
            "replicas": cluster.statefulset_status(request.namespace, request.name)["replicas"],
            "selector": ",".join(f"{key}={value}" for key, value in labels.items()),
        },
    }


def read_statefulset(cluster: ClusterState, request: Request) -> dict[str, Any]:
    return {
        **_statefulset(cluster, request),
        "status": cluster.statefulset_status(request.namespace, request.name),
    }


def _merge_patch(request: Request) -> Any:
    """The request's JSON merge patch; 415 for another media type, 400 for a body that is not JSON."""
    if request.content_type != MERGE_PATCH:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types include: {MERGE_PATCH}",
        )
    try:
        return json.loads(request.body or b"{}")
    except ValueError as err:
        raise ApiError(400, "BadRequest", f"error decoding patch: {err}") from None


def patch_scale(cluster: ClusterState, request: Request) -> dict[str, Any]:
    patch = _merge_patch(request)
    spec = patch.get("spec") if isinstance(patch, dict) else None
    _statefulset(cluster, request)
    if isinstance(spec, dict) and "replicas" in spec:
        replicas = spec["replicas"]
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise ApiError(
                400, "BadRequest", f"spec.replicas: cannot unmarshal {json.dumps(replicas)} into int32"
            )
        if replicas < 0:
            raise ApiError(
                422,
                "Invalid",
                f'Scale.autoscaling "{request.name}" is invalid: spec.replicas: '
                f"Invalid value: {replicas}: must be greater than or equal to 0",
            )
        cluster.scale_statefulset(request.namespace, request.name, replicas)
    return read_scale(cluster, request)


# -- Jobs -------------------------------------------------------------------------------------------
def create_job(cluster: ClusterState, request: Request) -> dict[str, Any]:
    """A Job of the request's namespace, started by the local Job controller; the created object."""
    job = request.json()
    if not isinstance(job, dict) or job.get("apiVersion") != "batch/v1" or job.get("kind") != "Job":
        raise ApiError(400, "BadRequest", "the request body is not a batch/v1 Job")
    meta = job.get("metadata") or {}
    name = meta.get("name") or ""
    if meta.get("namespace", request.namespace) != request.namespace:
        raise ApiError(
            400,
            "BadRequest",
            "the namespace of the provided object does not match the namespace sent on the request",
        )
    if request.namespace not in cluster.namespaces:
        raise ApiError(404, "NotFound", f'namespaces "{request.namespace}" not found')
    try:
        created = cluster.create_job({**job, "metadata": {**meta, "namespace": request.namespace}})
    except ClusterError as err:
        raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: {err}') from None
    if created is None:
        raise ApiError(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
    return {**created.manifest, "status": created.status()}


def read_job(cluster: ClusterState, request: Request) -> dict[str, Any]:
    job = cluster.jobs.get((request.namespace, request.name))
    if job is None:
        raise ApiError(404, "NotFound", f'jobs.batch "{request.name}" not found')
    return {**job.manifest, "status": job.status()}


def patch_job(cluster: ClusterState, request: Request) -> dict[str, Any]:
    """A merge patch of a Job's ownerReferences (a list replaces them, null removes them); the patched Job."""
    patch = _merge_patch(request)
    meta = patch.get("metadata") if isinstance(patch, dict) else None
    if not isinstance(meta, dict) or set(patch) != {"metadata"} or set(meta) != {"ownerReferences"}:
        raise ApiError(
            422, "Invalid", f"only metadata.ownerReferences of a Job is patched here, not {json.dumps(patch)}"
        )
    if (request.namespace, request.name) not in cluster.jobs:
        raise ApiError(404, "NotFound", f'jobs.batch "{request.name}" not found')
    try:
        job = cluster.patch_job_owners(request.namespace, request.name, meta["ownerReferences"])
    except ClusterError as err:
        raise ApiError(422, "Invalid", f'Job.batch "{request.name}" is invalid: {err}') from None
    return {**job.manifest, "status": job.status()}


def delete_job(cluster: ClusterState, request: Request) -> dict[str, Any]:
    """Delete a Job at once, its pods as DeleteOptions.propagationPolicy says (a Job's default: Orphan)."""
    options = request.json() if request.body else {}
    policy = options.get("propagationPolicy", "Orphan") if isinstance(options, dict) else None
    if policy not in ("Orphan", "Background", "Foreground"):
        raise ApiError(
            422, "Invalid", f"DeleteOptions is invalid: propagationPolicy: Unsupported value: {policy!r}"
        )
    job = cluster.delete_job(request.namespace, request.name, with_pods=policy != "Orphan")
    if job is None:
        raise ApiError(404, "NotFound", f'jobs.batch "{request.name}" not found')
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": {
            "name": request.name,
            "group": "batch",
            "kind": "jobs",
            "uid": job.manifest["metadata"]["uid"],
        },
    }


ROUTES = (
    Route("GET", _object_path("apps", "v1", "statefulsets"), "apps", "statefulsets", read_statefulset),
    Route(
        "GET", _object_path("apps", "v1", "statefulsets", "scale"), "apps", "statefulsets/scale", read_scale
    ),
    Route(
        "PATCH",
        _object_path("apps", "v1", "statefulsets", "scale"),
        "apps",
        "statefulsets/scale",
        patch_scale,
    ),
    Route(
        "POST", re.compile(_collection_path("batch", "v1", "jobs")), "batch", "jobs", create_job, success=201
    ),
    Route("GET", _object_path("batch", "v1", "jobs"), "batch", "jobs", read_job),
    Route("PATCH", _object_path("batch", "v1", "jobs"), "batch", "jobs", patch_job),
    Route("DELETE", _object_path("batch", "v1", "jobs"), "batch", "jobs", delete_job),
)


# -- serving ----------------------------------------------------------------------------------------
def answer(
    cluster: ClusterState, method: str, target: str, headers: Message, body: bytes
) -> tuple[int, dict[str, Any]]:
    """One API request: authenticated, routed, authorized, handled: its status code and object. Raises
    ApiError for a refusal."""
    scheme, _, token = (headers.get("Authorization") or "").partition(" ")
    user = cluster.authenticate(token.strip()) if scheme.lower() == "bearer" else None
    if user is None:
        raise ApiError(401, "Unauthorized", "Unauthorized")
    path = urlsplit(target).path
    matches = [(route, found) for route in ROUTES if (found := route.pattern.fullmatch(path))]
    if not matches:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    routed = next(((route, found) for route, found in matches if route.method == method), None)
    if routed is None:
        raise ApiError(
            405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
        )
    route, found = routed
    namespace, name, verb = found["namespace"], found.groupdict().get("name") or "", VERBS[method]
    if not cluster.rbac.allows(user, verb, route.group, route.resource, namespace, name):
        raise ApiError(
            403,
            "Forbidden",
            f'{route.qualified(name)} is forbidden: User "system:serviceaccount:'
            f'{user[0]}:{user[1]}" cannot {verb} resource "{route.resource}" in API '
            f'group "{route.group}" in the namespace "{namespace}"',
        )
    return route.success, route.handler(cluster, Request(namespace, name, body, headers.get_content_type()))


def _handler(cluster: ClusterState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30

        def log_message(self, format: str, *args: Any) -> None:  # the request line: method, path, code
            log.debug("API %s", format % args)

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                code, payload = answer(cluster, self.command, self.path, self.headers, body)
            except ApiError as refused:
                code, payload = refused.code, refused.status()
            except Exception:  # a fault of this server, answered as the API server does
                log.exception("API %s %s failed", self.command, self.path)
                code, payload = 500, ApiError(500, "InternalError", "an error on the server").status()
            send_json(self, code, json.dumps(payload).encode())

        do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _answer

    return Handler


class _TlsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], context: ssl.SSLContext):
        super().__init__(("127.0.0.1", 0), handler)
        self.context = context

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(30)  # the TLS handshake happens here, on this connection's own thread
        with self.context.wrap_socket(request, server_side=True) as connection:
            super().finish_request(connection, client_address)

    def handle_error(
        self, request: Any, client_address: Any
    ) -> None:  # a client that refused the certificate
        log.debug("API connection from %s ended", client_address, exc_info=True)


def write_certificate(certificate: Path, key: Path) -> None:
    """A self-signed server certificate for 127.0.0.1 and kubernetes.default.svc, its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver (local cluster)")])
    now = dt.datetime.now(dt.UTC)
    identifier = x509.SubjectKeyIdentifier.from_public_key(private.public_key())
    built = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("kubernetes.default.svc")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(identifier, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(identifier), critical=False
        )
        .sign(private, hashes.SHA256())
    )
    key.touch(mode=0o600)
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    certificate.write_bytes(built.public_bytes(serialization.Encoding.PEM))


class ApiServer:
    """The cluster's API over HTTPS on 127.0.0.1 (a free port), serving in a background thread."""

    def __init__(self, cluster: ClusterState, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_file, key_file = directory / "ca.crt", directory / "tls.key"
        write_certificate(self.ca_file, key_file)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca_file, key_file)
        self.server = _TlsServer(_handler(cluster), context)
        self.port: int = self.server.server_port
        self.url = f"https://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
