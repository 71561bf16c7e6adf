"""The HTTP endpoints of a long-running command: /metrics, /healthz and /readyz.

A stdlib ThreadingHTTPServer on a daemon thread: /metrics is prometheus_client's exposition of a Metrics
registry (OpenMetrics when the scraper asks for it, the text format version 0.0.4 otherwise), /healthz and
/readyz answer 200 or 503 with one line of text from consumers/runtime/probes.py. A connection that sends
nothing, or too slowly, is closed after REQUEST_TIMEOUT_S, so idle sockets cannot pile up threads in the
service.
"""

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import choose_encoder

from consumers.runtime.metrics import Metrics
from consumers.runtime.probes import Probes

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0  # a scrape takes milliseconds; a connection silent this long is dropped
PATHS = ("/metrics", "/healthz", "/readyz")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a connection still open never holds up the service's exit
    block_on_close = False


class StatusServer:
    """Serves `metrics` and `probes` at http://host:port/{metrics,healthz,readyz} until close(); port 0 in
    the config means off, so this class is only built for a real port (0 here: any free port, for tests)."""

    def __init__(
        self,
        metrics: Metrics,
        probes: Probes,
        host: str,
        port: int,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # the stdlib sets it on each connection's socket

            def do_GET(self):  # the stdlib names it
                path = self.path.split("?")[0]
                if path in ("/metrics", "/"):
                    encode, content_type = choose_encoder(self.headers.get("Accept", ""))
                    self._answer(200, encode(metrics.registry), content_type)
                elif path in ("/healthz", "/readyz"):
                    ok, text = probes.alive() if path == "/healthz" else probes.ready()
                    self._answer(200 if ok else 503, (text + "\n").encode(), "text/plain; charset=utf-8")
                else:
                    self.send_error(404, f"{path} is not served here; these are: {', '.join(PATHS)}")

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):  # scrapes and probes every few seconds: no log line each
                pass

        try:
            self._server = _Server((host, port), Handler)
        except OSError as error:
            raise OSError(
                f"metrics endpoint: cannot listen on {host}:{port} ({error}); choose another metrics_port, or 0 "
                "to turn the endpoint off"
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="txs-metrics", daemon=True)
        self._thread.start()
        log.info("http endpoints url=http://%s:%d paths=%s", host, self.port, ",".join(PATHS))

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
