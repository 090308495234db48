"""HTTP/1.1 over a bounded pool of workers: every connection is answered, none is held idle.

The standard library's `ThreadingHTTPServer` listens with a backlog of 5
and runs a thread for every connection for as long as it stays open; under
200 concurrent clients most new connections are reset before any thread
sees them, and an agent harness's idle keep-alive connection holds a thread
for as long as it likes. Here:

    listen(backlog) --accept--> selector --readable--> work queue --> workers
                                   ^       (bounded: full -> 503)       |
                                   +------ keep-alive, after a reply ---+

  * one thread accepts and watches the idle connections, new or kept alive
    (a selector); a connection with bytes to read goes to the work queue
    (one that sends nothing holds no worker), and one of
    `workers` threads serves exactly one request on it, then hands it back
    to the selector (keep-alive) or closes it;
  * when the work queue is full (`max_pending` connections already wait for
    a worker) or `max_connections` are open, the connection is answered
    `503` with `Retry-After` at once, counted `http/busy` (resp.
    `http/too_many_connections`), and closed gracefully: the server stops
    writing, reads what the client still sends and closes on its EOF, so the
    client reads the 503 instead of a reset;
  * an idle connection is closed after `idle_seconds`; once a request's
    first bytes arrived, each read of the rest may wait `request_seconds`
    (a client that trickles its request holds a worker that long a read).

A request is served by the handler class's `handle_one_request` (the
standard library's parsing); `Responder` writes its reply: one JSON body,
or a server-sent event stream (chunked transfer encoding, so the connection
stays reusable). Every reply is encodable whatever its strings hold: lone
surrogates (a model can sample a JSON escape of one) become U+FFFD.
"""

from __future__ import annotations

import collections
import http.server
import json
import queue
import re
import selectors
import socket
import threading
import time

from absl import logging

_SURROGATE = re.compile("[\ud800-\udfff]")
_STOP = object()


class SendFailed(Exception):
  """A reply could not be encoded (`started` False: nothing was written) or written."""

  def __init__(self, reason: str, started: bool):
    super().__init__(reason)
    self.reason, self.started = reason, started


def encode_json(payload) -> bytes:
  """`payload` as UTF-8 JSON; lone surrogates become U+FFFD; NaN and inf raise ValueError."""
  text = json.dumps(payload, ensure_ascii=False, allow_nan=False)
  return _SURROGATE.sub("\ufffd", text).encode("utf-8")


def clean_text(value):
  """`value` (str, or lists / dicts of them) with lone surrogates as U+FFFD: what a
  client receives, so what a session compares the client's next request with."""
  if isinstance(value, str):
    return _SURROGATE.sub("\ufffd", value)
  if isinstance(value, list):
    return [clean_text(v) for v in value]
  if isinstance(value, dict):
    return {k: clean_text(v) for k, v in value.items()}
  return value


class Responder:
  """Writes one request's reply on `handler`: `json`, or `start_stream` / `event` /
  `end_stream`. Each raises `SendFailed` when the reply cannot be encoded or sent."""

  def __init__(self, handler: http.server.BaseHTTPRequestHandler):
    self._h = handler
    self.started = False  # bytes of a status line went out

  def _write(self, data: bytes):
    try:
      self._h.wfile.write(data)
    except OSError as e:
      self._h.close_connection = True
      raise SendFailed("write_failed", True) from e

  def _head(self, status: int, headers: dict):
    self.started = True
    h = self._h
    try:
      h.send_response(status)
      for k, v in headers.items():
        h.send_header(k, v)
      if h.close_connection:
        h.send_header("Connection", "close")
      h.end_headers()
    except OSError as e:
      h.close_connection = True
      raise SendFailed("write_failed", True) from e

  def json(self, status: int, payload, headers: dict | None = None) -> None:
    try:
      data = encode_json(payload)
    except (ValueError, TypeError, RecursionError) as e:
      raise SendFailed("unencodable", self.started) from e
    self._head(
      status,
      {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})},
    )
    self._write(data)

  def start_stream(self) -> None:
    self._head(
      200,
      {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "Transfer-Encoding": "chunked",
      },
    )

  def event(self, payload) -> None:
    """One `data: <json>` event (`payload` "[DONE]": the end marker, as OpenAI sends it)."""
    try:
      data = b"[DONE]" if payload == "[DONE]" else encode_json(payload)
    except (ValueError, TypeError, RecursionError) as e:
      raise SendFailed("unencodable", True) from e
    data = b"data: " + data + b"\n\n"
    self._write(b"%x\r\n%s\r\n" % (len(data), data))

  def end_stream(self) -> None:
    self._write(b"0\r\n\r\n")


class Handler(http.server.BaseHTTPRequestHandler):
  """A connection's state across its requests; the worker calls `handle_one_request`.

  Subclasses define `do_GET` etc. (the standard library's dispatch).
  """

  protocol_version = "HTTP/1.1"  # keep-alive: a harness reuses its connection
  disable_nagle_algorithm = True  # a reply's head and body go out at once

  def __init__(self, connection, client_address, server):
    # Not BaseRequestHandler's: that serves the whole connection in the constructor.
    self.request, self.connection, self.client_address = connection, connection, client_address
    self.server = server
    self.timeout = server.request_seconds
    self.setup()  # rfile, wfile; the socket's timeout
    self.close_connection = False

  def log_message(self, format, *args):
    logging.debug("http: " + format, *args)

  def pending_bytes(self) -> bool:
    """Bytes of a next request already read into `rfile`'s buffer, or waiting on the
    socket (a pipelined request: the selector would not see them)."""
    self.connection.settimeout(0)
    try:
      return bool(self.rfile.peek(1))
    except OSError:
      return False
    finally:
      self.connection.settimeout(self.timeout)


def _at_eof(conn: socket.socket) -> bool:
  try:
    return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
  except (BlockingIOError, InterruptedError):
    return False
  except OSError:
    return True


def _busy_reply(retry_after: int, message: str) -> bytes:
  body = encode_json(
    {"error": {"message": message, "type": "server_error", "param": None, "code": "server_busy"}}
  )
  head = (
    f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(body)}\r\nRetry-After: {retry_after}\r\n"
    f"Connection: close\r\n\r\n"
  )
  return head.encode() + body


class PooledHTTPServer:
  """Serves `handler_class` on `address` over `workers` threads (module docstring).

  `counts` (a Counter, shared with the caller) gets `http/accepted`,
  `http/busy`, `http/too_many_connections`, `http/idle_closed`,
  `http/request_errors`. Attributes the handler may read: `request_seconds`
  and whatever the caller sets on the server.
  """

  def __init__(
    self,
    address,
    handler_class,
    *,
    workers: int = 64,
    max_pending: int = 256,
    backlog: int = 1024,
    max_connections: int = 4096,
    idle_seconds: float = 600.0,
    request_seconds: float = 60.0,
    retry_after: int = 1,
    counts: collections.Counter | None = None,
  ):
    if workers < 1 or max_pending < 1 or backlog < 1 or max_connections < 1:
      raise ValueError("workers, max_pending, backlog and max_connections must be >= 1")
    self.handler_class, self.request_seconds = handler_class, request_seconds
    self.idle_seconds, self.retry_after = idle_seconds, int(retry_after)
    self.max_connections = max_connections
    self.counts = collections.Counter() if counts is None else counts
    self._count_lock = threading.Lock()
    self._sock = socket.create_server(address, backlog=backlog)
    self._sock.setblocking(False)
    self.server_address = self._sock.getsockname()
    self._work: queue.Queue = queue.Queue(max_pending)
    self._parked: collections.deque = collections.deque()  # handed back by workers
    self._open: set = set()  # every connection's handler, idle or in service
    self._open_lock = threading.Lock()
    self._wake_r, self._wake_w = socket.socketpair()
    self._wake_r.setblocking(False)
    self._closing = threading.Event()
    self._selector = selectors.DefaultSelector()
    self._selector.register(self._sock, selectors.EVENT_READ, "accept")
    self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
    self._idle: dict = {}  # handler -> parked since
    self._drain: dict = {}  # socket -> deadline
    self._threads = [
      threading.Thread(target=self._work_loop, name=f"http-worker-{k}", daemon=True)
      for k in range(workers)
    ]
    self._threads.append(
      threading.Thread(target=self._select_loop, name="http-select", daemon=True)
    )
    for t in self._threads:
      t.start()

  def count(self, key: str, n: int = 1) -> None:
    with self._count_lock:
      self.counts[key] += n

  @property
  def open_connections(self) -> int:
    return len(self._open)

  # --- the selector thread ------------------------------------------------------------

  def _select_loop(self):
    last_sweep = time.monotonic()
    while not self._closing.is_set():
      for key, _ in self._selector.select(timeout=1.0):
        if key.data == "accept":
          self._accept()
        elif key.data == "wake":
          self._wake_r.recv(4096)
        elif key.data == "drain":
          self._drain_one(key.fileobj)
        else:
          self._ready(key.data)
      while self._parked:
        handler = self._parked.popleft()
        self._idle[handler] = time.monotonic()
        self._selector.register(handler.connection, selectors.EVENT_READ, handler)
      if time.monotonic() - last_sweep >= 1.0:
        last_sweep = time.monotonic()
        self._sweep(last_sweep)
    self._shut_selected()

  def _accept(self):
    while True:
      try:
        conn, address = self._sock.accept()
      except (BlockingIOError, InterruptedError):
        return
      except OSError as e:  # e.g. out of file descriptors: the client is left in the backlog
        logging.warning("http: accept failed: %r", e)
        return
      self.count("http/accepted")
      if len(self._open) >= self.max_connections:
        self.count("http/too_many_connections")
        self._refuse(conn, f"{self.max_connections} connections are open")
        continue
      conn.setblocking(True)
      try:
        handler = self.handler_class(conn, address, self)
      except OSError:
        conn.close()
        continue
      with self._open_lock:
        self._open.add(handler)
      # To a worker once its request's bytes arrive: a client that connects and sends
      # nothing holds no worker (and is closed when idle too long).
      self._idle[handler] = time.monotonic()
      self._selector.register(conn, selectors.EVENT_READ, handler)

  def _ready(self, handler):
    """`handler`'s connection has bytes to read: to a worker, or 503 if none is free."""
    self._selector.unregister(handler.connection)
    self._idle.pop(handler, None)
    try:
      self._work.put_nowait(handler)
    except queue.Full:
      if _at_eof(handler.connection):  # the client closed its idle connection
        self._close(handler)
        return
      self.count("http/busy")
      self._forget(handler)
      self._refuse(handler.connection, "every worker is busy")

  def _refuse(self, conn: socket.socket, why: str):
    """503 + Retry-After, then a graceful close (no reset: the client reads the 503)."""
    try:
      conn.setblocking(False)
      conn.send(
        _busy_reply(
          self.retry_after, f"the server is busy ({why}); retry after {self.retry_after} s"
        )
      )
      conn.shutdown(socket.SHUT_WR)
      self._drain[conn] = time.monotonic() + 10.0
      self._selector.register(conn, selectors.EVENT_READ, "drain")
    except OSError:
      conn.close()

  def _drain_one(self, conn: socket.socket):
    try:
      if conn.recv(65536):
        return  # the rest of its request; wait for its EOF
    except (BlockingIOError, InterruptedError):
      return
    except OSError:
      pass
    self._selector.unregister(conn)
    self._drain.pop(conn, None)
    conn.close()

  def _sweep(self, now: float):
    for conn in [c for c, deadline in self._drain.items() if deadline < now]:
      self._selector.unregister(conn)
      del self._drain[conn]
      conn.close()
    for handler in [h for h, since in self._idle.items() if now - since > self.idle_seconds]:
      self._selector.unregister(handler.connection)
      del self._idle[handler]
      self.count("http/idle_closed")
      self._close(handler)

  def _shut_selected(self):
    for handler in list(self._idle):
      self._close(handler)
    for conn in list(self._drain):
      conn.close()
    self._selector.close()
    self._sock.close()

  # --- workers ------------------------------------------------------------------------

  def _work_loop(self):
    while True:
      handler = self._work.get()
      if handler is _STOP:
        return
      self._serve(handler)

  def _serve(self, handler):
    """One request on `handler`'s connection (and any pipelined after it, in order)."""
    while True:
      try:
        handler.handle_one_request()
      except Exception as e:  # noqa: BLE001  # a broken connection
        self.count("http/request_errors")
        logging.debug("http: a request failed: %r", e)
        handler.close_connection = True
      if handler.close_connection or self._closing.is_set():
        self._close(handler)
        return
      if not handler.pending_bytes():
        self._parked.append(handler)
        self._wake()
        return

  def _wake(self):
    try:
      self._wake_w.send(b"x")
    except OSError:
      pass  # closed, or the pipe is full: the selector wakes anyway

  def _forget(self, handler):
    with self._open_lock:
      self._open.discard(handler)

  def _close(self, handler):
    self._forget(handler)
    try:
      handler.finish()
    except OSError:
      pass
    try:
      handler.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    handler.connection.close()

  def close(self, timeout: float = 10.0) -> None:
    """Stops accepting, ends every connection (a request in flight is answered first,
    unless it waits on its client) and joins the threads."""
    self._closing.set()
    self._wake()
    self._threads[-1].join(timeout)  # the selector: idle connections closed
    with self._open_lock:
      busy = list(self._open)
    for handler in busy:  # a worker blocked reading its client returns
      try:
        handler.connection.shutdown(socket.SHUT_RD)
      except OSError:
        pass
    deadline = time.monotonic() + timeout
    for _ in self._threads[:-1]:
      try:
        self._work.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
      except queue.Full:
        break  # workers still stuck on requests: daemon threads, left behind
    for t in self._threads[:-1]:
      t.join(max(0.0, deadline - time.monotonic()))
    with self._open_lock:
      left = list(self._open)
    for handler in left:  # parked after the selector stopped
      self._close(handler)
    self._wake_r.close()
    self._wake_w.close()
