"""A fault-injecting HTTP proxy on 127.0.0.1, put in front of moto's S3 server or the SGLang stand-in.

Requests pass through unchanged unless a rule matches (method + path regex); a rule fires `times`
times and then lets requests through again. Actions:
  status          answer with `code` and `body` without forwarding (503 SlowDown, 500)
  reset_request   read half the request body, then reset the connection (a dropped upload)
  reset_response  forward, send the headers and half the body, then reset (a dropped download)
  delay           wait `seconds` before forwarding (a server slower than the client's timeout)
  truncate        forward, then send only the first half of the body with a matching length
  transform       forward, then send `transform(body)` (wrong shapes, NaN rows)
  stale           answer the next GETs of a key with the last body the proxy returned for it
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
}


@dataclass
class Rule:
    action: str
    method: str = "*"
    path: str = ".*"
    times: int = 1
    code: int = 503
    body: bytes = b""
    seconds: float = 0.0
    transform: Callable[[bytes], bytes] | None = None
    fired: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            self.fired < self.times
            and self.method in ("*", method)
            and re.search(self.path, path) is not None
        )


@dataclass
class FaultProxy:
    upstream_host: str
    upstream_port: int
    rules: list[Rule] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_get: dict[str, tuple[int, list, bytes]] = field(default_factory=dict)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def take(self, method: str, path: str) -> Rule | None:
        with self.lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if rule.action != "stale" and rule.matches(method, path):
                    rule.fired += 1
                    return rule
        return None

    def start(self) -> FaultProxy:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _reset(connection: socket.socket) -> None:
    """Close with RST, as a dropped connection does."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


def _handler(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _body(self, partial: bool = False) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                    if partial:
                        break
                return b"".join(chunks)
            length = int(self.headers.get("Content-Length", 0))
            return self.rfile.read(length // 2 if partial else length)

        def _forward(self, body: bytes) -> tuple[int, list, bytes]:
            upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=120)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            upstream.close()
            keep = HOP_BY_HOP - ({"content-length"} if self.command == "HEAD" else set())
            return response.status, [(k, v) for k, v in response.getheaders() if k.lower() not in keep], data

        def _send(self, status: int, headers: list, body: bytes, length: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(body) if length is None else length))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            self.close_connection = True

        def _handle(self) -> None:
            rule = proxy.take(self.command, self.path)
            key = self.path.split("?")[0]
            if rule is not None and rule.action == "reset_request":
                self._body(partial=True)
                _reset(self.connection)
                self.close_connection = True
                return
            body = self._body()
            if rule is not None and rule.action == "status":
                self._send(rule.code, [("Content-Type", "application/xml")], rule.body)
                return
            if rule is not None and rule.action == "delay":
                time.sleep(rule.seconds)
            if self.command == "GET" and key in proxy.last_get:
                with proxy.lock:
                    stale = next(
                        (r for r in proxy.rules if r.action == "stale" and r.matches("GET", key)), None
                    )
                    if stale is not None:
                        stale.fired += 1
                if stale is not None:
                    self._send(*proxy.last_get[key])
                    return
            status, headers, data = self._forward(body)
            if self.command == "GET" and status == 200 and "?" not in self.path:
                with proxy.lock:
                    if not any(r.action == "stale" and r.matches("GET", key) for r in proxy.rules):
                        proxy.last_get[key] = (status, headers, data)
            if rule is not None and rule.action == "reset_response":
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                _reset(self.connection)
                self.close_connection = True
                return
            if rule is not None and rule.action == "truncate":
                data = data[: len(data) // 2]
            if rule is not None and rule.action == "transform":
                data = rule.transform(data)
            self._send(status, headers, data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    return Handler
