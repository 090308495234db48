"""The OpenAI endpoint under many concurrent clients: every connection answered?

    nice python benchmarks/openai_clients.py [--clients 32,200] [--rounds 3] [--sample_ms 50]

One process: the endpoint's app (`openai_api.OpenAIApp`, Qwen3's tokenizer
and chat format) over a fake batcher that answers every request after
`--sample_ms` (the transport is measured, not a model), served by

  * stdlib: the standard library's `ThreadingHTTPServer` (listen backlog 5,
    a thread per connection), the baseline the pooled server replaced;
  * pooled: `openai_api.Server` (`http_server.PooledHTTPServer`: backlog
    1024, 64 workers, 1024 waiting, then 503 + Retry-After);
  * pooled-small: the same with 8 workers and 32 waiting, to show the 503s.

Each round opens `clients` new connections at once (a barrier), each one
POST /v1/chat/completions; per transport: replies 200, replies 503 (with
Retry-After), connections that failed (reset, refused, no reply), median
and p99 latency of the 200s, and the round's wall time. Rounds interleave
the transports; the table sums rounds (latencies pooled over rounds).
"""

import argparse
import collections
import concurrent.futures as cf
import http.client
import http.server
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sao_jax.envs import chat
from sao_jax.envs.tokenizer import TOKENIZERS
from sao_jax.serving import batcher as batcher_lib
from sao_jax.serving import http_server, openai_api, sessions

TOK = TOKENIZERS["qwen3"]()
FMT = chat.make_format("qwen3", TOK)
BODY = json.dumps(
  {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
)


class FakeBatcher:
  max_len, generated_tokens, engine_errors = 4096, 0, 0
  engine = type("E", (), {"version": 0})()

  def __init__(self, seconds: float):
    self.seconds = seconds
    ids = TOK.encode("Hello there.") + [FMT.turn_end_id]
    self.completion = batcher_lib.Completion(tuple(ids), (-0.5,) * len(ids), (0,) * len(ids), True)

  def submit(self, prompt, max_new_tokens, *, sampling=None, prefix_key=None):
    del prompt, max_new_tokens, sampling, prefix_key
    future = cf.Future()
    threading.Timer(self.seconds, future.set_result, (self.completion,)).start()
    return future


def make_app(seconds: float):
  book = sessions.SessionBook(FMT, TOK.vocab_size, 4096, lambda t: None, max_sessions=1 << 20)
  return openai_api.OpenAIApp(
    FakeBatcher(seconds), FMT, TOK, book, model_name="fake", max_turn_tokens=8
  )


class _StdlibHandler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def log_message(self, *args):
    pass

  def do_POST(self):
    body = self.rfile.read(int(self.headers["Content-Length"]))
    headers = {k.lower(): v for k, v in self.headers.items()}
    self.server.app.handle("POST", self.path, headers, body, http_server.Responder(self))


class StdlibServer:
  """The app on the standard library's ThreadingHTTPServer: the baseline the pooled server replaced."""

  def __init__(self, app):
    self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StdlibHandler)
    self._http.daemon_threads = True
    self._http.app = app
    self.app, self.port = app, self._http.server_address[1]
    self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
    self._thread.start()

  def close(self):
    self._http.shutdown()
    self._http.server_close()


def hammer(port: int, clients: int) -> tuple[list, float]:
  start = threading.Barrier(clients)

  def one(_):
    start.wait()
    t0 = time.perf_counter()
    try:
      conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
      conn.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
      r = conn.getresponse()
      r.read()
      conn.close()
      return r.status, r.getheader("Retry-After"), time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
      return type(e).__name__, None, time.perf_counter() - t0

  t0 = time.perf_counter()
  with cf.ThreadPoolExecutor(clients) as pool:
    got = list(pool.map(one, range(clients)))
  return got, time.perf_counter() - t0


TRANSPORTS = {
  "stdlib": lambda app: StdlibServer(app),
  "pooled": lambda app: openai_api.Server(app),
  "pooled-small": lambda app: openai_api.Server(app, workers=8, max_pending=32),
}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--clients", default="32,200")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--sample_ms", type=float, default=50.0)
  args = parser.parse_args()
  print(
    "| clients | server | replies 200 | replies 503 (Retry-After) | failed connections "
    "| 200s: median / p99 ms | wall s (mean) | /v1/stats http/busy |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for clients in [int(c) for c in args.clients.split(",")]:
    totals = {name: collections.Counter() for name in TRANSPORTS}
    latencies = {name: [] for name in TRANSPORTS}
    walls = {name: [] for name in TRANSPORTS}
    for _ in range(args.rounds):
      for name, make in TRANSPORTS.items():  # interleaved
        server = make(make_app(args.sample_ms / 1000))
        try:
          got, wall = hammer(server.port, clients)
          busy = server.app.stats().get("http/busy", 0)
        finally:
          server.close()
        walls[name].append(wall)
        totals[name]["busy"] += busy
        for status, retry, seconds in got:
          if status == 200:
            totals[name]["200"] += 1
            latencies[name].append(seconds * 1000)
          elif status == 503:
            totals[name]["503"] += 1
            totals[name]["retry_after"] += retry is not None
          else:
            totals[name]["failed"] += 1
            totals[name][f"failed/{status}"] += 1
    for name in TRANSPORTS:
      t, lat = totals[name], np.asarray(latencies[name] or [np.nan])
      kinds = ", ".join(f"{k[7:]} {v}" for k, v in sorted(t.items()) if k.startswith("failed/"))
      print(
        f"| {clients} x {args.rounds} | {name} | {t['200']} | {t['503']} ({t['retry_after']}) "
        f"| {t['failed']}{f' ({kinds})' if kinds else ''} | {np.median(lat):.0f} / "
        f"{np.percentile(lat, 99):.0f} | {np.mean(walls[name]):.2f} | {t['busy']} |"
      )


if __name__ == "__main__":
  main()
