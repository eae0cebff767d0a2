"""A fault-injecting HTTP proxy on loopback, in front of a real (moto) S3 server.

Why a proxy: the relay must survive what a real object store and network do (5xx, SlowDown,
resets, stalls, torn or corrupted bodies, acknowledged-but-lost writes), and those faults live
on the wire, below s3fs and botocore. Injecting them there exercises the real retry and
verification code of every layer, with no mock of our own code.

Use: `proxy = FaultProxy(region.endpoint).start()`; give s3fs `proxy.options(region)` (the same
storage_options with `endpoint_url` pointing here); add rules; read `proxy.log`.

A `Rule` matches by HTTP method(s) and a regex searched in the request path (`/bucket/key`, URL
decoded, query excluded), fires with a probability (seeded RNG, so a run is reproducible) after
skipping `after` matches and at most `times` times. Actions:

  error            answer `status` with an S3 error body (`code`), request not forwarded
  error_after      forward (the store applies it), then answer `status`: an ambiguous write
  reset            close the connection with RST, request not forwarded
  reset_after      forward, then RST: the write happened, the client never hears
  delay            sleep `seconds`, then forward (longer than the client's read timeout: a timeout)
  truncate         forward, send the response with its full Content-Length but only `fraction` of the body
  truncate_request forward a PUT whose body is cut to `fraction` (Content-Length adjusted): a torn upload
                   that a store without end-to-end checksums accepts
  flip             forward, flip one random bit of the response body
  flip_request     flip one random bit of the PUT body before forwarding

A changed body travels without its x-amz-checksum-* / Content-MD5 headers (moto would store it and
botocore would then refuse every read): the faults model a store or path with no end-to-end
checksum, so what must catch them is the relay's own verification, as on file:// or any fsspec store.
  drop             answer a PUT 200 with a made-up ETag without forwarding: a lost write
  unconditional    forward without If-Match / If-None-Match: a store that ignores conditional writes

Every injection is appended to `log` as an `Injection` (method, path, action, detail).
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import sys
import threading
import time
import uuid
from pathlib import Path
from dataclasses import dataclass
from typing import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

ACTIONS = {"error", "error_after", "reset", "reset_after", "delay", "truncate", "truncate_request", "flip",
           "flip_request", "drop", "unconditional"}

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect",
        "content-length", "host"}


@dataclass
class Rule:
    action: str
    methods: tuple[str, ...] = ("GET", "PUT", "HEAD", "POST", "DELETE")
    key: str = ""  # regex searched in the decoded path
    probability: float = 1.0
    times: int | None = None  # at most this many injections
    after: int = 0  # let this many matching requests through first
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0
    fraction: float = 0.5
    name: str = ""
    matched: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; known: {sorted(ACTIONS)}")
        if isinstance(self.methods, str):
            self.methods = (self.methods,)
        self._re = re.compile(self.key)


@dataclass(frozen=True)
class Injection:
    at: float
    method: str
    path: str
    action: str
    detail: str = ""
    rule: str = ""


@dataclass
class _Request:
    method: str
    path: str  # decoded, no query
    target: str  # as received, with query
    headers: list[tuple[str, str]]
    body: bytes


_ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
              '<RequestId>{rid}</RequestId></Error>')
_MESSAGES = {"SlowDown": "Please reduce your request rate.", "InternalError": "We encountered an internal error. "
             "Please try again.", "ServiceUnavailable": "Service is unable to handle request."}


class FaultProxy:
    """Threaded loopback proxy: forwards every request to `upstream`, injecting faults by rule."""

    def __init__(self, upstream: str, seed: int = 0, keep_host: bool = False) -> None:
        """`keep_host`: forward the client's Host header (a store that checks signatures, such as Ceph RGW,
        refuses a request whose signed Host changed on the way; moto checks none)."""
        self.keep_host = keep_host
        u = urlsplit(upstream)
        self.upstream_host, self.upstream_port = u.hostname, u.port or 80
        self.rng = random.Random(seed)
        self.rules: list[Rule] = []
        self.log: list[Injection] = []
        self.requests = 0
        self.forwarded = 0
        self.served: list[tuple[str, str, int, int]] = []  # (method, path, status, body bytes) of each answer relayed
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- configuration --------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def options(self, base: dict, **config: object) -> dict:
        """s3fs storage_options: `base` (a region's) with the endpoint pointed at this proxy.

        `config` goes to botocore's Config (e.g. read_timeout=1, retries={"max_attempts": 2}).
        """
        out = {**base, "endpoint_url": self.endpoint}
        if config:
            out["config_kwargs"] = {**base.get("config_kwargs", {}), **config}
        return out

    def add(self, action: str, **kw: object) -> Rule:
        rule = Rule(action, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule: the fault is gone."""
        with self._lock:
            self.rules.clear()

    def injected(self, action: str | None = None, key: str = "") -> list[Injection]:
        with self._lock:
            return [i for i in self.log if (action is None or i.action == action) and re.search(key, i.path)]

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for i in self.log:
                out[i.action] = out.get(i.action, 0) + 1
        return out

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="faultproxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- decisions ------------------------------------------------------------------------------
    def _choose(self, req: _Request) -> tuple[Rule | None, random.Random]:
        with self._lock:
            self.requests += 1
            for rule in self.rules:
                if req.method not in rule.methods or not rule._re.search(req.path):
                    continue
                rule.matched += 1
                if rule.matched <= rule.after or (rule.times is not None and rule.fired >= rule.times):
                    continue
                if self.rng.random() >= rule.probability:
                    continue
                rule.fired += 1
                # a per-request RNG drawn under the lock keeps bit positions reproducible across threads
                return rule, random.Random(self.rng.getrandbits(64))
        return None, self.rng

    def _record(self, req: _Request, rule: Rule, detail: str = "") -> None:
        with self._lock:
            self.log.append(Injection(time.time(), req.method, req.path, rule.action, detail, rule.name))

    def _forward(self, req: _Request, body: bytes | None = None) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in req.headers if k.lower() not in _HOP}
            if body is not None:  # a body changed on the way: the store cannot tell (no end-to-end checksum)
                headers = {k: v for k, v in headers.items() if not _checksum_header(k)}
            data = req.body if body is None else body
            host = next((v for k, v in req.headers if k.lower() == "host"), None) if self.keep_host else None
            headers["Host"] = host or f"{self.upstream_host}:{self.upstream_port}"
            if req.method not in ("GET", "HEAD") or data:
                headers["Content-Length"] = str(len(data))
            conn.request(req.method, req.target, body=data if data else None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            with self._lock:
                self.forwarded += 1
            keep = [(k, v) for k, v in resp.getheaders()
                    if k.lower() not in _HOP or (req.method == "HEAD" and k.lower() == "content-length")]
            return resp.status, resp.reason, keep, payload
        finally:
            conn.close()


def _checksum_header(name: str) -> bool:
    name = name.lower()
    return name.startswith("x-amz-checksum-") or name in ("content-md5", "x-amz-sdk-checksum-algorithm")


def _flip(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if not data:
        return data, "empty body, nothing to flip"
    pos = rng.randrange(len(data) * 8)
    out = bytearray(data)
    out[pos // 8] ^= 1 << (pos % 8)
    return bytes(out), f"bit {pos % 8} of byte {pos // 8} of {len(data)}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (its timeout) while we stall or send: expected here, not worth a traceback."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, *args: object) -> None:  # quiet: the injection log is what tests read
        pass

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        try:
            self.connection.close()
        except OSError:
            pass

    def _send(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes, *,
              declared: int | None = None, close: bool = False) -> None:
        self.send_response_only(status, reason)
        for k, v in headers:
            self.send_header(k, v)
        length = len(body) if declared is None else declared
        if self.command != "HEAD" or declared is not None:
            self.send_header("Content-Length", str(length))
        elif not any(k.lower() == "content-length" for k, _ in headers):
            self.send_header("Content-Length", "0")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _error(self, status: int, code: str) -> None:
        body = _ERROR_XML.format(code=code, message=_MESSAGES.get(code, code), rid=uuid.uuid4().hex).encode()
        self._send(status, http.client.responses.get(status, "Error"),
                   [("Content-Type", "application/xml"), ("x-amz-request-id", uuid.uuid4().hex)], body)

    def _handle(self) -> None:
        owner = self.owner
        target = self.path
        req = _Request(self.command, unquote(urlsplit(target).path), target, list(self.headers.items()),
                       self._read_body())
        rule, rng = owner._choose(req)
        act = rule.action if rule else None
        if act == "error":
            owner._record(req, rule, f"{rule.status} {rule.code}")
            return self._error(rule.status, rule.code)
        if act == "reset":
            owner._record(req, rule, "reset before forwarding")
            return self._reset()
        if act == "drop" and req.method == "PUT":
            owner._record(req, rule, f"acknowledged {len(req.body)} bytes, not stored")
            etag = '"' + uuid.uuid4().hex + '"'
            return self._send(200, "OK", [("ETag", etag), ("x-amz-request-id", uuid.uuid4().hex)], b"")
        if act == "delay":
            owner._record(req, rule, f"{rule.seconds:g}s stall")
            time.sleep(rule.seconds)
        if act == "unconditional":
            dropped = [k for k, _ in req.headers if k.lower() in ("if-match", "if-none-match")]
            if dropped:
                owner._record(req, rule, f"dropped {', '.join(dropped)}")
                req.headers = [(k, v) for k, v in req.headers if k not in dropped]
        body = None
        if act == "truncate_request" and req.body:
            body = req.body[: int(len(req.body) * rule.fraction)]
            owner._record(req, rule, f"forwarded {len(body)} of {len(req.body)} bytes")
        if act == "flip_request":
            body, detail = _flip(req.body, rng)
            owner._record(req, rule, detail)
        try:
            status, reason, headers, payload = owner._forward(req, body)
        except OSError:
            return self._error(502, "BadGateway")
        if act == "error_after":
            owner._record(req, rule, f"upstream said {status}, client told {rule.status} {rule.code}")
            return self._error(rule.status, rule.code)
        if act == "reset_after":
            owner._record(req, rule, f"upstream said {status}, connection reset")
            return self._reset()
        if act == "truncate" and payload:
            cut = int(len(payload) * rule.fraction)
            owner._record(req, rule, f"sent {cut} of {len(payload)} bytes, then closed")
            return self._send(status, reason, headers, payload[:cut], declared=len(payload), close=True)
        if act == "flip" and payload and 200 <= status < 300:
            payload, detail = _flip(payload, rng)
            headers = [(k, v) for k, v in headers if not _checksum_header(k)]  # so our own check must catch it
            owner._record(req, rule, detail)
        with owner._lock:
            owner.served.append((req.method, req.path, status, len(payload)))
        self._send(status, reason, headers, payload)

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_HEAD = do_POST = do_DELETE = do_GET


# -- checks shared by the fault suite ----------------------------------------------------------------


def same_bits(a: dict, b: dict) -> bool:
    from codec.tensors import same_bits as exact

    return exact(a, b)


class Oracle:
    """The trainer's published states, against which every exposure of weights is checked.

    `on_update` is handed to watchers: each call must carry exactly the state published as that
    step, and steps must never go back. `dest(path)` checks what a reader of DEST sees.
    Violations are collected (a watcher thread would only log an assertion) and asserted by `ok()`.
    """

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}
        self.updates: dict[str, list[int]] = {}
        self.violations: list[str] = []
        self._lock = threading.Lock()

    def published(self, step: int, state: dict) -> None:
        self.states[step] = {k: v.detach().clone() for k, v in state.items()}

    def hook(self, name: str) -> "Callable[[int, dict], None]":
        """An on_update for one watcher (steps must increase per watcher, not across watchers)."""

        def on_update(step: int, tensors: dict) -> None:
            with self._lock:
                seen = self.updates.setdefault(name, [])
                if seen and step <= seen[-1]:
                    self.violations.append(f"{name}: on_update went from step {seen[-1]} to {step}")
                seen.append(step)
                if step not in self.states:
                    self.violations.append(f"{name}: on_update step {step} was never published")
                elif not same_bits(tensors, self.states[step]):
                    self.violations.append(f"{name}: on_update step {step}: tensors differ from the trainer's")

        return on_update

    def on_update(self, step: int, tensors: dict) -> None:
        self.hook("watcher")(step, tensors)

    @property
    def update_count(self) -> int:
        return sum(len(v) for v in self.updates.values())

    def dest(self, path, allowed: set[int] | None = None) -> int | None:
        """The step DEST shows (None: nothing yet), after checking it is complete and exactly the trainer's."""
        import json
        import os

        from relay import checkpoint

        path = os.fspath(path)
        for _attempt in range(20):
            # A live watcher removes superseded versions right after its swap, so a version resolved
            # here may vanish mid-read; a reader then resolves again (docs/PROTOCOL.md, section 6).
            found = self._read_dest(path, os, json, checkpoint)
            if found != "vanished":
                break
        else:
            raise AssertionError(f"{path}: the resolved version kept vanishing")
        if found is None:
            return None
        resolving, current, step, files, tensors = found
        for n in resolving:
            # The link text, not its resolution: resolving each name later than .current races with a
            # swap the watcher may make meanwhile (then the name rightly leads into the newer step).
            link = os.path.join(path, n)
            if not os.path.islink(link) or os.readlink(link) != os.path.join(".current", n):
                self.violations.append(f"{path}/{n} does not lead into .current")
        expect = {"relay-state.json"} if not files else files | {"relay-state.json", checkpoint.INDEX_NAME}
        if set(resolving) != expect:
            self.violations.append(f"{path} shows {sorted(resolving)} for step {step}, expected {sorted(files)}")
        if step not in self.states:
            self.violations.append(f"{path} holds step {step}, never published")
        elif not same_bits(tensors, self.states[step]):
            self.violations.append(f"{path} holds step {step} with tensors other than the trainer's")
        if allowed is not None and step not in allowed:
            self.violations.append(f"{path} holds step {step}, expected one of {sorted(allowed)}")
        return step

    @staticmethod
    def _read_dest(path, os, json, checkpoint):
        """(visible names, resolved version, step, weight files, tensors), None before the first
        step, or "vanished" when the resolved version was removed under the read."""
        visible = [n for n in os.listdir(path) if not n.startswith(".")] if os.path.isdir(path) else []
        resolving = [n for n in visible if os.path.exists(os.path.join(path, n))]
        if not resolving:
            return None
        current = os.path.realpath(os.path.join(path, ".current"))  # resolve once, as readers are told to
        try:
            with open(os.path.join(current, "relay-state.json")) as f:
                state = json.load(f)
            if state.get("persist") == "journal":  # base + journal: only relay-state.json is visible
                from relay import dest

                try:
                    _, tensors = dest.load_version(Path(current))
                except dest.BadVersion:
                    if os.path.isdir(current):
                        raise
                    return "vanished"
                return resolving, current, state["step"], set(), tensors
            with open(os.path.join(current, checkpoint.INDEX_NAME)) as f:
                files = set(json.load(f)["weight_map"].values())
            tensors, _ = checkpoint.load(current)
        except (FileNotFoundError, RuntimeError) as exc:
            if os.path.isdir(current) or (isinstance(exc, RuntimeError) and "No such file" not in str(exc)):
                raise
            return "vanished"
        return resolving, current, state["step"], files, tensors

    def ok(self) -> None:
        assert not self.violations, self.violations
