"""How the local stand-in servers (SGLang's HTTP API, the Kubernetes API server) send a JSON answer, and
where one that this machine starts may listen."""

from __future__ import annotations

from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler

from pipeline.processes import free_port as free_port  # where the stand-ins' tests take their ports


def send_json(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    """Answer the handler's request with `status` and the JSON document `body` (already encoded)."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def send_json_chunks(handler: BaseHTTPRequestHandler, status: int, pieces: Iterable[bytes]) -> None:
    """Answer with a JSON document sent as it is produced, piece by piece (chunked transfer encoding), so
    a body of gigabytes is never held whole."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    for piece in pieces:
        if piece:
            handler.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
    handler.wfile.write(b"0\r\n\r\n")
