"""An HTTP proxy in front of the local S3 server that can take the endpoint away.

Why a proxy: the moto server itself cannot be paused mid-request, and a fault must hit the
store between two requests of one persist, then go away again. Modes:

* ``up``: forward every request;
* ``down``: close every connection without an answer (an endpoint that went away);
* ``slowdown``: answer ``503 SlowDown`` (S3's throttling reply) to the next ``budget``
  requests, then forward again.

``attempts`` counts the requests per ``(method, path)`` in the current mode, so a test can
check that retries are bounded.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import threading

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")


class S3Proxy:
    def __init__(self, target_host: str, target_port: int):
        self.mode, self.budget = "up", 0
        self.attempts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                action = proxy._route(self.command, self.path)
                if action == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if action == "slowdown":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                upstream = http.client.HTTPConnection(target_host, target_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                upstream.request(self.command, self.path, body=body, headers=headers)
                reply = upstream.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _route(self, method: str, path: str) -> str:
        with self._lock:
            self.attempts[(method, path.split("?")[0])] += 1
            if self.mode == "down":
                return "drop"
            if self.mode == "slowdown" and self.budget > 0:
                self.budget -= 1
                return "slowdown"
            return "forward"

    def set_mode(self, mode: str, budget: int = 0) -> None:
        with self._lock:
            self.mode, self.budget = mode, budget
            self.attempts.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
