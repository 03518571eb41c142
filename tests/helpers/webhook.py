"""A Slack-like webhook receiver for the notification tests (stdlib ``ThreadingHTTPServer``), bound to
loopback or, for jobs on the cluster's nodes, to the host's address on the cluster network."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: The secret part of every test webhook URL: no rendered or written file may contain it.
SECRET = "/hooks/T000/B000/s3cr3t-token-for-notify-tests"


class Receiver:
    """A Slack-like webhook on loopback: records each POSTed JSON body; ``fail_first`` answers 500
    that many times first; ``port`` brings one back where another was (0: any free port)."""

    def __init__(self, host: str = "127.0.0.1", fail_first: int = 0, port: int = 0) -> None:
        self.bodies: list[dict] = []
        self.fail_first = fail_first
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if outer.fail_first > 0:
                    outer.fail_first -= 1
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.bodies.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True  # back on the port of a receiver that was down
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://{host}:{self.server.server_address[1]}{SECRET}"

    def texts(self) -> list[str]:
        return [b["text"] for b in self.bodies]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
