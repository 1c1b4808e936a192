"""How the local stand-in servers (SGLang's HTTP API, the Kubernetes API server) send a JSON answer."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


def send_json(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    """Answer the handler's request with `status` and the JSON document `body` (already encoded)."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
