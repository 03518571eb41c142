"""``orchestrator ui``: the standard library's threading HTTP server over :mod:`orchestrator.ui.views`.

Safe by default:

* it binds 127.0.0.1; any other address needs a token (``--token`` or ``ORCHESTRATOR_UI_TOKEN``),
  sent once as ``?token=`` (kept in an HttpOnly, SameSite=Strict cookie) or as ``Authorization:
  Bearer``; compared in constant time;
* on a loopback address, a request naming another host (``Host:``) is refused: a web page elsewhere
  cannot reach the dashboard by pointing its own domain name at 127.0.0.1 (DNS rebinding);
* it is read-only: GET and HEAD only, nothing that cancels or resumes;
* pages are static shells; job names, arguments and log lines reach them as JSON and are put in the
  page as text by the browser (``textContent``), and a Content-Security-Policy allows scripts from
  this server only, so a ``<script>`` in a log line can neither render nor run.

The charts are plotly.js, served from the plotly Python package's own copy (no CDN: a login node
without internet shows them too).
"""

from __future__ import annotations

import hmac
import html
import json
import math
import mimetypes
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

from orchestrator.contract.errors import UserError
from orchestrator.ui.views import Views

STATIC = Path(__file__).with_name("static")
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
TOKEN_COOKIE = "orchestrator_ui_token"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
PAGES = {"": "jobs", "job": "job", "sweep": "sweep"}
#: ``--refresh`` bounds, seconds: faster than twice a second is a busy loop over the registry; slower
#: than an hour is not a live page (and a browser's timer overflows past 24.8 days: it fires at once).
REFRESH_MIN_S, REFRESH_MAX_S = 0.5, 3600.0


def plotly_js() -> Path:
    """plotly.js as the plotly package ships it (found without importing plotly: ~0.3 s)."""
    import importlib.util

    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("`orchestrator ui` needs plotly: pip install 'orchestrator[ui]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise UserError(f"plotly's bundled plotly.min.js is missing ({path}): reinstall plotly")
    return path


class Dashboard(ThreadingHTTPServer):
    daemon_threads = True
    #: connections the kernel holds until they are accepted (socketserver's default, 5, reset the
    #: rest of 100 browsers polling at once)
    request_queue_size = 128

    def __init__(self, host: str, port: int, views: Views, token: str | None, refresh_s: float) -> None:
        self.views = views
        self.token = token
        self.refresh_s = check_refresh(refresh_s)
        self.loopback = host in LOOPBACK
        self.plotly = plotly_js()
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), Handler)


class Handler(BaseHTTPRequestHandler):
    server: Dashboard
    server_version = "orchestrator-ui"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        # Access lines go to stderr without the query string: a ?token= never reaches a log.
        sys.stderr.write(f"{self.address_string()} {self.command} {urlsplit(self.path).path} {args[1:2]}\n")

    # ------------------------------------------------------------------------ dispatch
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if not self._host_allowed():
            self._send_text(403, "forbidden: this dashboard answers only to its own address")
            return
        if self.server.token is not None:
            given = query.get("token")
            if given is not None and hmac.compare_digest(given.encode(), self.server.token.encode()):
                # Once: the token moves into a cookie and out of the address bar (and history).
                self.send_response(303)
                self.send_header("Location", _same_page(url.path, url.query))
                self.send_header(
                    "Set-Cookie", f"{TOKEN_COOKIE}={self.server.token}; HttpOnly; SameSite=Strict; Path=/"
                )
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if not self._authorized():
                self._send_text(401, "unauthorized: open the address with ?token=<the dashboard's token>")
                return
        parts = [unquote(p) for p in url.path.strip("/").split("/")] if url.path.strip("/") else []
        try:
            if parts[:1] == ["static"] and len(parts) == 2:
                self._static(parts[1])
            elif parts[:1] == ["api"]:
                self._send_json(200, self._api(parts[1:], query))
            elif (len(parts) == 0) or (len(parts) == 2 and parts[0] in PAGES):
                self._page(PAGES[parts[0] if parts else ""], parts[1] if parts else "")
            else:
                self._send_text(404, "not found")
        except UserError as exc:
            self._send_json(404, {"error": str(exc)})
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # one page's failure is shown, the server keeps serving
            self._send_json(500, {"error": f"{type(exc).__name__}: {exc}"})

    def _api(self, parts: list[str], query: dict[str, str]) -> Any:
        views = self.server.views
        if parts == ["jobs"]:
            return views.jobs(query.get("state", ""), query.get("q", ""), _int(query, "page") or 0)
        if len(parts) == 2 and parts[0] == "job":
            return views.job(parts[1])
        if len(parts) == 3 and parts[0] == "job" and parts[2] == "chart":
            return views.chart(parts[1])
        if len(parts) == 3 and parts[0] == "job" and parts[2] == "cost":
            return views.cost(parts[1])
        if len(parts) == 3 and parts[0] == "job" and parts[2] == "logs":
            return views.logs(parts[1], _int(query, "node"), _int(query, "rank"), query.get("q", ""))
        if len(parts) == 2 and parts[0] == "sweep":
            return views.sweep(parts[1], query.get("metric", "loss"))
        raise UserError(f"no such endpoint: /api/{'/'.join(parts)}")

    # ------------------------------------------------------------------------ safety
    def _host_allowed(self) -> bool:
        if not self.server.loopback:
            return True  # behind the token
        host = (self.headers.get("Host") or "").strip()
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]", 1)[0]
        return name in LOOPBACK

    def _authorized(self) -> bool:
        token = self.server.token or ""
        offered: list[str] = []
        # RFC 7235: the scheme is case-insensitive ("bearer", "BEARER"), one or more spaces follow it.
        scheme, _, credentials = (self.headers.get("Authorization") or "").strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            offered.append(credentials.strip())
        for part in (self.headers.get("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == TOKEN_COOKIE:
                offered.append(value)
        return any(hmac.compare_digest(o.encode(), token.encode()) for o in offered)

    # ------------------------------------------------------------------------ answers
    def _page(self, page: str, ident: str) -> None:
        title = {"jobs": "jobs", "job": f"job {ident}", "sweep": f"sweep {ident}"}[page]
        body = (
            "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>orchestrator: {html.escape(title)}</title>"
            "<link rel='icon' href='data:,'><link rel='stylesheet' href='/static/app.css'>"
            "<script src='/static/plotly.min.js'></script><script src='/static/app.js' defer></script>"
            "</head>"
            f"<body data-page='{page}' data-id='{html.escape(ident, quote=True)}' "
            f"data-refresh-ms='{int(self.server.refresh_s * 1000)}'>"
            "<header><a href='/'>orchestrator</a> <span id='title'></span>"
            "<span id='updated' class='muted'></span></header><main id='main'></main></body></html>\n"
        )
        self._send(200, body.encode(), "text/html; charset=utf-8")

    def _static(self, name: str) -> None:
        if name == "plotly.min.js":
            path = self.server.plotly
        else:
            path = STATIC / name
            if name.startswith(".") or "/" in name or not path.is_file():
                self._send_text(404, "not found")
                return
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind.endswith("javascript"):
            kind += "; charset=utf-8"
        # plotly.js (4.6 MB) is cached by the browser; the dashboard's own files never go stale.
        self._send(
            200, path.read_bytes(), kind, cache="max-age=3600" if name == "plotly.min.js" else "no-cache"
        )

    def _send_json(self, code: int, data: Any) -> None:
        self._send(code, json.dumps(data, allow_nan=False, default=str).encode(), "application/json")

    def _send_text(self, code: int, text: str) -> None:
        self._send(code, (text + "\n").encode(), "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, kind: str, cache: str = "no-store") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", cache)
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _same_page(path: str, query: str) -> str:
    """Where ``?token=`` redirects: the same page and its other parameters, without the token. The
    request's path is already percent-encoded: each segment is decoded and encoded exactly once (a
    ``%2F`` inside an id stays one segment), and it always begins with a single ``/`` (never ``//host``,
    which a browser would read as another site)."""
    segments = [quote(unquote(s), safe="") for s in path.lstrip("/").split("/")]
    location = "/" + "/".join(segments)
    rest = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "token"]
    return location + ("?" + urlencode(rest) if rest else "")


def _int(query: dict[str, str], key: str) -> int | None:
    value = query.get(key, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"?{key}={value!r}: expected a whole number") from None


def check_refresh(seconds: float) -> float:
    """``--refresh``: a finite number of seconds in ``REFRESH_MIN_S..REFRESH_MAX_S`` (nan, inf, 0, a
    negative or a huge value is refused in one line, exit 2)."""
    if not (isinstance(seconds, int | float) and math.isfinite(seconds)) or not (
        REFRESH_MIN_S <= seconds <= REFRESH_MAX_S
    ):
        raise UserError(
            f"--refresh {seconds}: expected a number of seconds from {REFRESH_MIN_S:g} to {REFRESH_MAX_S:g}"
        )
    return float(seconds)


def check_binding(host: str, token: str | None) -> str | None:
    """The token to require: None on a loopback address without one; any other address needs one."""
    token = token or os.environ.get("ORCHESTRATOR_UI_TOKEN") or None
    if host not in LOOPBACK and not token:
        raise UserError(
            f"--host {host}: any address but 127.0.0.1 needs a token (--token, or ORCHESTRATOR_UI_TOKEN): "
            "the dashboard shows every job's logs"
        )
    if token is not None and len(token) < 16:
        raise UserError(
            "--token: use at least 16 characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)"
        )
    return token


def serve(
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    home: Path | None = None,
    refresh_s: float = 5.0,
    ready: threading.Event | None = None,
) -> None:
    """Serve until interrupted; prints the address first (port 0: a free one is chosen)."""
    token = check_binding(host, token)
    refresh_s = check_refresh(refresh_s)
    try:
        server = Dashboard(host, port, Views(home), token, refresh_s)
    except OSError as exc:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"orchestrator ui: serving http://{shown}:{server.server_address[1]}/", flush=True)
    if token is not None:
        print("orchestrator ui: open it once with ?token=<your token>", flush=True)
    if ready is not None:
        ready.set()
    started = time.monotonic()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
        print(f"orchestrator ui: stopped after {time.monotonic() - started:.0f} s", file=sys.stderr)
