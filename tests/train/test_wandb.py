"""Weights & Biases logging, in W&B's offline mode (no network): the run files read
back hold every TensorBoard scalar under the same name and step, and a resumed
writer continues the same W&B run; W&B's environment variables win over the
config's defaults; an offline run opens no connection off this machine."""

import glob
import json
import math
import os
import socket
import struct

import numpy as np
import pytest

from sao_jax.config import sections
from sao_jax.train.metrics import MetricsWriter, metric_name, sink_scalars, wandb_init_args

wandb = pytest.importorskip("wandb", reason="the 'wandb' extra (make test installs it)")
from tensorboardX.proto import event_pb2  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

OFFLINE = sections.Logging(wandb=True, wandb_project="sao-jax-test", wandb_mode="offline")


def wandb_records(path):
  """The records of a W&B run file (a LevelDB-style log: a 7-byte ":W&B" header,
  32 KiB blocks of [crc32 u32, length u16, type u8, data] chunks; FULL = 1,
  FIRST / MIDDLE / LAST = 2 / 3 / 4), read without W&B's reader."""
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  i, buf, out = 7, b"", []
  while i + 7 <= len(data):
    left = 32768 - i % 32768
    if left < 7:
      i += left
      continue
    _, n, kind = struct.unpack("<IHB", data[i : i + 7])
    if n == 0 and kind == 0:  # block padding
      i += left
      continue
    buf += data[i + 7 : i + 7 + n]
    i += 7 + n
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(buf)
      out.append(record)
      buf = b""
  return out


def wandb_history(run_file, run_records=None):
  """(run id, [{key: value}] per logged row) of one offline run file; the
  run records are appended to `run_records` if given."""
  run_id, rows = None, []
  for r in wandb_records(run_file):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      run_id = r.run.run_id
      if run_records is not None:
        run_records.append(r.run)
    elif kind == "history":
      row = {
        item.key or "/".join(item.nested_key): float(item.value_json) for item in r.history.item
      }
      rows.append({k: v for k, v in row.items() if not k.startswith("_")})  # W&B's own
  return run_id, rows


def tensorboard_scalars(directory):
  """{(tag, step): value} of the TFRecord event files under `directory`."""
  out = {}
  for file in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
    with open(file, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      event = event_pb2.Event()
      event.ParseFromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out[(v.tag, event.step)] = v.simple_value
  return out


def test_every_tensorboard_scalar_reaches_wandb_and_a_resume_continues_the_run(tmp_path):
  workdir = str(tmp_path)
  writer = MetricsWriter(workdir, tensorboard=True, wandb=OFFLINE, config={"seed": 3})
  for step in (1, 2):
    writer.write(step, {"loss": np.float32(1.0 / step), "lag_p90": float("nan")}, "sft")
  for step in (1, 2, 3):  # a later stage counts its own steps from 1 again
    writer.write(step, {"policy/loss": 0.5 * step, "ratio_mean": np.float32(1.0)}, "rl")
  writer.close()
  # Resumed: the same W&B run, its history going on from RL step 4.
  # (Without TensorBoard: a second event file opened in the same second
  # would take the first one's name.)
  writer = MetricsWriter(workdir, tensorboard=False, wandb=OFFLINE)
  writer.write(4, {"policy/loss": 2.0, "ratio_mean": 1.0}, "rl")
  writer.close()

  runs = sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")))
  histories = [wandb_history(run) for run in runs]
  with open(os.path.join(workdir, "wandb_run_id"), encoding="utf-8") as f:
    assert {run_id for run_id, _ in histories} == {f.read().strip()}
  rows = [row for _, h in histories for row in h]

  def points(rows):
    out = {}
    for row in rows:
      stage = next(k[:-5] for k in row if k.endswith("/step"))
      for k, v in row.items():
        if k != f"{stage}/step":
          out[(k, int(row[f"{stage}/step"]))] = v
    return out

  logged = {k: v for k, v in points(rows).items() if k[1] < 4}
  tb = tensorboard_scalars(os.path.join(workdir, "tensorboard"))
  assert logged.keys() == tb.keys()
  assert all(math.isclose(logged[k], tb[k], rel_tol=1e-6) for k in tb)
  assert ("sft/loss", 2) in logged and ("rl/policy/loss", 3) in logged
  resumed = {k: v for k, v in points(rows).items() if k[1] == 4}
  assert resumed == {("rl/policy/loss", 4): 2.0, ("rl/ratio_mean", 4): 1.0}
  assert not any("lag_p90" in k for k, _ in logged)  # non-finite: no point, as in TB


def test_logging_fields_are_checked():
  with pytest.raises(sections.ConfigError, match="logging.wandb_mode = 'cloud'"):
    sections.Logging(wandb=True, wandb_mode="cloud")
  with pytest.raises(sections.ConfigError, match="logging.wandb_project = ''"):
    sections.Logging(wandb_project="")


def test_one_name_per_metric_in_every_sink(tmp_path):
  """metric_name: no doubled stage prefix ("sft/sft/nll"), and "pass@1" kept in
  TensorBoard too (tensorboardX's add_scalar would write "pass_1")."""
  workdir = str(tmp_path)
  writer = MetricsWriter(workdir, tensorboard=True, wandb=OFFLINE)
  writer.write(5, {"sft/nll": 1.5}, "sft")
  writer.write(6, {"eval/heldout/pass@1": 0.25, "eval/pass@1": 0.25}, "eval")
  writer.write(7, {"policy/loss": 0.5}, "rl")
  writer.close()
  want = {("sft/nll", 5), ("eval/heldout/pass@1", 6), ("eval/pass@1", 6), ("rl/policy/loss", 7)}
  assert set(tensorboard_scalars(os.path.join(workdir, "tensorboard"))) == want
  (run,) = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  logged = {
    (k, int(row[s + "/step"]))
    for row in wandb_history(run)[1]
    for s in ("sft", "eval", "rl")
    if s + "/step" in row
    for k in row
    if k != s + "/step"
  }
  assert logged == want
  assert metric_name("value_pretrain", "critic/value_loss") == "value_pretrain/critic/value_loss"
  # metrics.jsonl keeps the stage's keys beside "stage"; sink_scalars names them as the sinks do.
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  assert records[2]["policy/loss"] == 0.5 and records[2]["stage"] == "rl"
  assert {(k, r["step"]) for r in records for k in sink_scalars(r)} == want


def test_wandb_environment_wins_over_config_defaults_and_set_fields_over_both(
  tmp_path, monkeypatch
):
  """WANDB_MODE=offline alone runs offline (the config's mode is unset), under
  W&B's project and name; a field set in the config wins over the variable."""
  for k in [k for k in os.environ if k.startswith("WANDB_")]:
    monkeypatch.delenv(k)
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_PROJECT", "from-env")
  monkeypatch.setenv("WANDB_NAME", "env-name")
  monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
  writer = MetricsWriter(str(tmp_path), tensorboard=False, wandb=sections.Logging(wandb=True))
  writer.write(1, {"loss": 1.0}, "sft")
  writer.close()
  (run,) = glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*", "run-*.wandb"))
  records = []
  wandb_history(run, records)
  assert (records[0].project, records[0].display_name, records[0].run_group) == (
    "from-env",
    "env-name",
    "env-group",
  )

  env = {
    "WANDB_MODE": "offline",
    "WANDB_PROJECT": "p",
    "WANDB_ENTITY": "e",
    "WANDB_NAME": "n",
    "WANDB_DIR": "/elsewhere",
    "WANDB_RESUME": "never",
  }
  args = wandb_init_args(str(tmp_path), sections.Logging(wandb=True), env)
  assert [args[k] for k in ("mode", "project", "entity", "name", "dir", "resume")] == [
    "offline",
    "p",
    "e",
    "n",
    None,
    None,
  ]  # None: W&B reads its variable itself
  set_ = sections.Logging(
    wandb=True, wandb_mode="online", wandb_project="q", wandb_entity="f", wandb_run_name="m"
  )
  args = wandb_init_args(str(tmp_path), set_, env)
  assert [args[k] for k in ("mode", "project", "entity", "name")] == ["online", "q", "f", "m"]
  args = wandb_init_args(str(tmp_path), sections.Logging(wandb=True), {})
  assert [args[k] for k in ("mode", "project", "entity", "name", "dir", "resume")] == [
    None,
    "sao-jax",
    None,
    os.path.basename(str(tmp_path)),
    str(tmp_path),
    "allow",
  ]


def test_an_offline_run_connects_to_nothing_off_this_machine(tmp_path, monkeypatch):
  """Every socket this process opens during an offline run (W&B's service
  talks to it over loopback) stays on this machine; W&B's service process
  starts with its error reporting off and no system metrics or machine probes."""
  tried = []
  real = {name: getattr(socket.socket, name) for name in ("connect", "connect_ex")}

  def guard(name):
    def connect(self, address):
      if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
        "127.0.0.1",
        "::1",
        "localhost",
      ):
        tried.append(address)
        raise OSError(f"network access in an offline run: {address}")
      return real[name](self, address)

    return connect

  for name in real:
    monkeypatch.setattr(socket.socket, name, guard(name))
  monkeypatch.delenv("WANDB_ERROR_REPORTING", raising=False)
  writer = MetricsWriter(str(tmp_path), tensorboard=False, wandb=OFFLINE)
  writer.write(1, {"loss": 1.0}, "sft")
  writer.close()
  assert not tried
  assert os.environ["WANDB_ERROR_REPORTING"] == "false"
  assert wandb_init_args(str(tmp_path), OFFLINE)["settings"] == {
    "console": "off",
    "x_disable_stats": True,
    "x_disable_machine_info": True,
  }


def test_an_offline_run_sends_no_request_from_wandbs_service_process(tmp_path, monkeypatch):
  """W&B's service (the wandb-core binary) is its own process, out of reach of a
  socket guard in this one; its HTTP clients (the API, uploads, error reports)
  follow the proxy variables, so every proxy variable here points at a trap
  on loopback that records each request it gets. (With WANDB_MODE=online and
  a fake key the trap gets the service's CONNECTs to W&B's API host: it sees
  that process's traffic.) Direct sockets that ignore proxies are not covered."""
  import threading

  trap = socket.create_server(("127.0.0.1", 0))
  requests = []

  def record():
    while True:
      try:
        conn, _ = trap.accept()
      except OSError:  # closed: the run is over
        return
      with conn:
        conn.settimeout(5)
        try:
          requests.append(conn.recv(256).split(b"\r\n")[0])
        except OSError:
          requests.append(b"(no request line)")

  threading.Thread(target=record, daemon=True).start()
  proxy = f"http://127.0.0.1:{trap.getsockname()[1]}"
  for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY"):
    monkeypatch.setenv(name, proxy)
  for name in ("NO_PROXY", "no_proxy", "WANDB_ERROR_REPORTING"):
    monkeypatch.delenv(name, raising=False)
  writer = MetricsWriter(str(tmp_path), tensorboard=False, wandb=OFFLINE)
  for step in range(3):
    writer.write(step, {"loss": 1.0 / (step + 1)}, "rl")
  writer.close()  # W&B's teardown: the service process has exited
  trap.close()
  assert not requests
