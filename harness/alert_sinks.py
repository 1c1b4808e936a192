"""Local sinks that receive what the drafter's notifiers send, for tests on 127.0.0.1:

    python -m harness.alert_sinks http --port P --out requests.jsonl
        every request (Slack's incoming webhook and a generic webhook alike) as one JSON line: method,
        path, headers, body; answers 200 "ok", as Slack does.
    DRAFTER_SMTP_SINK_PASSWORD=SECRET python -m harness.alert_sinks smtp --port P --out DIR --login USER
        an SMTP server (aiosmtpd) that requires that login and password (AUTH without TLS, as on a local
        relay) and writes each message it accepts to DIR/<n>.eml.

Each runs until it is sent SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PASSWORD_VARIABLE = "DRAFTER_SMTP_SINK_PASSWORD"


def serve_http(port: int, out: Path) -> None:
    lock = threading.Lock()

    class Recorder(BaseHTTPRequestHandler):
        def _record(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode(errors="replace") if length else ""
            entry = {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
            with lock, out.open("a") as sink:
                sink.write(json.dumps(entry) + "\n")
            answer = b"ok"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        do_POST = do_PUT = do_GET = _record

        def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Recorder)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()


def serve_smtp(port: int, out: Path, login: str, password: str) -> None:
    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult, LoginPassword

    out.mkdir(parents=True, exist_ok=True)

    class Writer:
        count = 0

        async def handle_DATA(self, server, session, envelope) -> str:
            Writer.count += 1
            staged = out / f".{Writer.count}.eml"
            staged.write_bytes(envelope.original_content or envelope.content)
            staged.rename(out / f"{Writer.count}.eml")
            return "250 Message accepted for delivery"

    def authenticate(server, session, envelope, mechanism, auth_data) -> AuthResult:
        accepted = (
            isinstance(auth_data, LoginPassword)
            and auth_data.login.decode() == login
            and auth_data.password.decode() == password
        )
        return AuthResult(success=accepted)

    controller = Controller(
        Writer(),
        hostname="127.0.0.1",
        port=port,
        authenticator=authenticate,
        auth_required=True,
        auth_require_tls=False,
    )
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    controller.start()
    try:
        stopped.wait()
    finally:
        controller.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.alert_sinks")
    sinks = parser.add_subparsers(dest="sink", required=True)
    http = sinks.add_parser("http")
    smtp = sinks.add_parser("smtp")
    for sink in (http, smtp):
        sink.add_argument("--port", type=int, required=True)
        sink.add_argument("--out", type=Path, required=True)
    smtp.add_argument("--login", required=True)
    args = parser.parse_args(argv)
    if args.sink == "http":
        serve_http(args.port, args.out)
    else:
        serve_smtp(args.port, args.out, args.login, os.environ[PASSWORD_VARIABLE])


if __name__ == "__main__":
    main()
