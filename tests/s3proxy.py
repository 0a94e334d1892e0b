"""A fault-injecting HTTP proxy for tests, in front of moto's S3 server on 127.0.0.1.

    python s3proxy.py --upstream http://127.0.0.1:PORT --control FILE --port-file FILE

It forwards every request to the upstream unchanged and relays the answer, unless the faults in the
JSON object of `--control` (re-read whenever the file changes; missing or {} means none) say
otherwise. Keys, each optional:

* ``"error_rate": 0.2, "error_codes": [503, 500]``: that share of requests is answered with one of
  those statuses (503 as S3's SlowDown, 500 as InternalError) without reaching the store;
* ``"reset_rate": 0.1``: that share of requests has its connection reset (RST) without an answer;
* ``"latency_s": 2``: every request waits that long before it is forwarded;
* ``"down": true``: the store is gone: every request's connection is reset at once;
* ``"down_from_put": "text"``: as ``down``, from the first PUT whose path contains that text ("" for
  any PUT) on, that PUT included: an outage that starts at a known step rather than at a time;
* ``"lose_put_answers": N``: the next N PUTs (counted from when the faults were last set) reach the store and succeed there, but their answers are
  lost (the client's connection is reset after the store answered); with ``"lose_match": "text"``
  only PUTs whose path contains that text count.

Decisions are random with ``"seed"`` (default 0). Counters go to ``<control>.stats`` (JSON, rewritten
after every request): requests, forwarded, errors, resets, lost_put_answers, down_resets; one line per
request (time, method, path, range, what was done) to ``<control>.log``.
Tests start it as a separate process and stop it by PID (`ProxyProcess`).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional, Tuple
from urllib.parse import unquote, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}
_BODIES = {503: ("SlowDown", "Please reduce your request rate."),
           500: ("InternalError", "We encountered an internal error. Please try again.")}


class _Faults:
    def __init__(self, control: str):
        self.control = control
        self.lock = threading.Lock()
        self.stamp = None
        self.spec: dict = {}
        self.rng = random.Random(0)
        self.lost_in_spec = 0  # answers lost since the faults last changed
        self.tripped = False  # down_from_put has seen its PUT since the faults last changed
        self.stats = {"requests": 0, "forwarded": 0, "errors": 0, "resets": 0, "lost_put_answers": 0,
                      "down_resets": 0}

    def current(self) -> dict:
        try:
            st = os.stat(self.control)
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        with self.lock:
            if stamp != self.stamp:
                self.stamp = stamp
                spec = {}
                if stamp is not None:
                    try:
                        with open(self.control) as f:
                            spec = json.loads(f.read() or "{}")
                    except (OSError, ValueError):
                        spec = self.spec  # caught mid-write: keep the last one
                if spec.get("seed") != self.spec.get("seed"):
                    self.rng = random.Random(spec.get("seed", 0))
                self.spec = spec
                self.lost_in_spec = 0
                self.tripped = False
            return dict(self.spec)

    def decide(self, method: str, path: str = "") -> str:
        """forward, error:<code>, reset, down or lose (forward, then reset instead of answering)."""
        spec = self.current()
        with self.lock:
            self.stats["requests"] += 1
            trip = spec.get("down_from_put")
            if trip is not None and not self.tripped and method == "PUT" and trip in path:
                self.tripped = True
                with open(self.control + ".log", "a") as f:
                    f.write(f"DOWN from PUT {path}\n")
            if spec.get("down") or self.tripped:
                self.stats["down_resets"] += 1
                return "down"
            if method == "PUT" and self._lost_left(spec) > 0 and spec.get("lose_match", "") in path:
                self.stats["lost_put_answers"] += 1
                self.lost_in_spec += 1
                return "lose"
            r = self.rng.random()
            if r < spec.get("error_rate", 0.0):
                self.stats["errors"] += 1
                return f"error:{self.rng.choice(spec.get('error_codes', [503]))}"
            if self.rng.random() < spec.get("reset_rate", 0.0):
                self.stats["resets"] += 1
                return "reset"
            self.stats["forwarded"] += 1
            return "forward"

    def _lost_left(self, spec: dict) -> int:
        return int(spec.get("lose_put_answers", 0)) - self.lost_in_spec

    def note(self, line: str) -> None:
        with self.lock:
            with open(self.control + ".log", "a") as f:
                f.write(line + "\n")

    def save_stats(self) -> None:
        with self.lock:
            blob = json.dumps(self.stats)
        tmp = f"{self.control}.stats.{threading.get_ident()}"
        with open(tmp, "w") as f:
            f.write(blob)
        os.replace(tmp, self.control + ".stats")


def _handler(upstream: str, faults: _Faults):
    up = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _reset(self) -> None:
            try:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            self.close_connection = True
            try:
                self.connection.close()
            except OSError:
                pass

        def _handle(self) -> None:
            body = self._body()
            action = faults.decide(self.command, self.path)
            faults.note(f"{time.time():.3f} {self.command} {self.path} {self.headers.get('Range', '')} "
                        f"len={len(body)} -> {action}")
            try:
                latency = float(faults.current().get("latency_s", 0.0))
                if latency and action != "down":
                    time.sleep(latency)
                if action in ("down", "reset"):
                    self._reset()
                    return
                if action.startswith("error:"):
                    code = int(action.split(":")[1])
                    name, text = _BODIES.get(code, ("InternalError", "error"))
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{name}</Code>'
                               f"<Message>{text}</Message><RequestId>proxy</RequestId></Error>").encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
                finally:
                    conn.close()
                if action == "lose":  # the store has it; the client never hears
                    self._reset()
                    return
                self.send_response(status, reason)
                for k, v in resp_headers:  # a HEAD's Content-Length is the object's: kept as it is
                    if k.lower() not in _HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                faults.save_stats()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--port-file", required=True)
    args = p.parse_args(argv)
    faults = _Faults(args.control)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(args.upstream, faults))
    server.daemon_threads = True
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    server.serve_forever(poll_interval=0.1)
    return 0


class ProxyProcess:
    """The proxy as a child process (stopped by PID): `endpoint`, `set(**faults)`, `stats()`."""

    def __init__(self, upstream: str, directory: str):
        self.control = os.path.join(directory, "proxy-faults.json")
        port_file = os.path.join(directory, "proxy-port")
        self.set()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--upstream", upstream,
                                      "--control", self.control, "--port-file", port_file])
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the S3 fault proxy did not start")
            time.sleep(0.02)
        with open(port_file) as f:
            self.endpoint = f"http://127.0.0.1:{int(f.read())}"

    def set(self, **faults) -> None:
        """Replace the faults (none: forward everything)."""
        tmp = self.control + ".tmp"
        with open(tmp, "w") as f:
            json.dump(faults, f)
        os.replace(tmp, self.control)

    def stats(self) -> dict:
        try:
            with open(self.control + ".stats") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def requests(self) -> List[Tuple[float, str, str]]:
        """Every request logged so far as (arrival time, method, path with query)."""
        try:
            with open(self.control + ".log") as f:
                rows = [line.split()[:3] for line in f if line[:1].isdigit()]
        except FileNotFoundError:
            return []
        return [(float(t), method, path) for t, method, path in rows]

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def request_kind(method: str, path: str) -> str:
    """A short name for a request: its S3 operation and the part of the key that says what it is."""
    path, _, query = unquote(path).partition("?")
    parts = path.strip("/").split("/")
    key = "/".join(parts[1:])
    if method == "GET" and ("list-type" in query or "prefix=" in query or not key):
        prefix = next((q.split("=", 1)[1] for q in query.split("&") if q.startswith("prefix=")), "")
        return f"LIST {shape_key(prefix)}"
    if method == "HEAD" and not key:
        return "HEAD bucket"
    return f"{method} {shape_key(key)}"


def shape_key(key: str) -> str:
    """The key with the run's own names and numbers blurred, so equal steps of batches compare."""
    out = []
    for part in key.split("/")[1:]:  # the first part is the test's base directory
        out.append("".join("N" if c.isdigit() else c for c in part) if any(c.isdigit() for c in part) else part)
    return "/".join(out)


if __name__ == "__main__":
    sys.exit(main())
