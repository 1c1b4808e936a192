"""The few Kubernetes API calls the pipeline makes from inside its own pods, as the pod's service
account: the multi-node trainer's Job (pipeline.training.nodes) and the SGLang fleets' StatefulSet scale
(pipeline.ops.fleets). Plain HTTPS with the token and CA the kubelet mounts, so the pipeline image needs
no Kubernetes client; the RBAC it needs is in infra/k8s/drafter-namespace.yaml."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class NotInCluster(RuntimeError):
    """This process does not run in a pod of a cluster (no service host, no service account token)."""


class KubernetesApiError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        """An unreachable or failing API server (5xx) may answer on a second try; 4xx will not."""
        return self.status is None or self.status >= 500


class KubernetesApi:
    """Calls as this pod's service account. The token is read for every call: the kubelet rotates it on
    disk, and a training run outlives one token."""

    def __init__(self, server: str, token_file: Path, ca_file: Path | None):
        self.server, self.token_file, self.ca_file = server.rstrip("/"), token_file, ca_file

    @classmethod
    def in_cluster(cls) -> KubernetesApi:
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        if not host or not (SERVICE_ACCOUNT_DIR / "token").is_file():
            raise NotInCluster(
                "no Kubernetes service host or service account token: this process runs outside "
                "a pod of a cluster"
            )
        return cls(f"https://{host}:{port}", SERVICE_ACCOUNT_DIR / "token", SERVICE_ACCOUNT_DIR / "ca.crt")

    # -- batch/v1 Jobs ---------------------------------------------------------------------------
    def create_job(self, namespace: str, job: dict[str, Any]) -> bool:
        """False when a Job of that name exists already."""
        response = self._call("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", job, allowed=(409,))
        return response.status_code != 409

    def read_job(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}").json()

    def set_job_owners(self, namespace: str, name: str, owners: list[dict[str, Any]] | None) -> None:
        """Replace a Job's ownerReferences (None: remove them, so no garbage collection deletes it)."""
        self._call(
            "PATCH",
            f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
            {"metadata": {"ownerReferences": owners}},
            content_type="application/merge-patch+json",
        )

    def delete_job(self, namespace: str, name: str) -> None:
        # Background: the Job goes at once, its pods after it
        self._call(
            "DELETE",
            f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
            {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            allowed=(404,),
        )

    # -- apps/v1 StatefulSets --------------------------------------------------------------------
    def read_statefulset(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call("GET", f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}").json()

    def scale_statefulset(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set the replica count through the scale subresource (what `kubectl scale` does)."""
        return self._call(
            "PATCH",
            f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}/scale",
            {"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        ).json()

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        allowed: tuple[int, ...] = (),
        content_type: str = "application/json",
    ):
        import requests

        headers = {
            "Authorization": f"Bearer {self.token_file.read_text().strip()}",
            "Content-Type": content_type,
        }
        try:
            response = requests.request(
                method,
                self.server + path,
                json=body,
                headers=headers,
                timeout=30,
                verify=str(self.ca_file) if self.ca_file else True,
            )
        except requests.RequestException as err:
            raise KubernetesApiError(f"{method} {path}: {type(err).__name__}: {err}") from err
        if response.status_code >= 400 and response.status_code not in allowed:
            try:
                reason = response.json().get("message", "")
            except ValueError:
                reason = response.text[:200]
            raise KubernetesApiError(
                f"{method} {path}: HTTP {response.status_code} {reason}", response.status_code
            )
        return response
