"""The fleet's weight channel: how each version goes from the trainer to the rollouts.

`fleet.weights_path` names one entry of `CHANNELS`. The trainer's fleet
source (train/sources.py) publishes through the entry's publisher, each
rollout process (train/fleet_worker.py) follows through its follower;
neither knows which channel it has. Both entries keep versions as orbax
checkpoints under `<root>/weights` (fleet.WeightPublisher), the bootstrap of
a late or restarted rollout:

    checkpoint  every version is a checkpoint, restored by the rollouts
                (fleet.WeightFollower).
    direct      every version is served from the trainer's devices and
                pulled into the rollouts' over the network
                (weight_transfer.py; with `fleet.delta_versions`, as its
                delta from the version before, weight_delta.py); every
                `fleet.checkpoint_every`-th, the first and the last are also
                checkpoints, the fallback after a failed pull. Where
                jax.experimental.transfer is unavailable or a server does
                not start, it runs on checkpoints alone, the reason logged
                and counted.

The trainer's side, a publisher: `publish(params, version)` hands a version
over and returns the metrics of the hand-over; `report()` its counters for
the step's metrics; `close(finished)` waits for what is in flight (after a
normal finish the last version is on disk); `describe` says which channel
runs (the trainer's start-up line). The rollout's side, a follower, has
`fleet.WeightFollower.poll`'s contract: `poll(final)` -> (params, version,
meta) of a whole new version or None, never blocking on a transfer;
`version`, `retarget`, `close`, and `pulling` (the version in flight, or
None). The entry's `counts(follower)` are its counters for the rollout
worker's result.

Adding a channel is one `WeightChannel` in `CHANNELS` (docs/DESIGN.md,
"Extension points"); `check_fleet_section` (which
train/configuration.validate calls) then accepts its name.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from sao_jax.config import sections
from sao_jax.data import identity as identity_lib
from sao_jax.transport import fleet, weight_delta, weight_transfer


def _as_is(params):
  return params


def _print(line: str) -> None:
  print(line, flush=True)


# ----------------------------------------------------------------- trainer side
class CheckpointPublisher:
  """Every version an orbax checkpoint (`fleet.WeightPublisher`).

  `cast` (params -> what the engines hold, precision.cast_for_serving) runs
  once per version. With an `identity` (identity.Published) every version is
  fingerprinted as published and carries the run id and its fingerprint.
  `meta`: what every version carries besides (a LoRA run's base
  fingerprint, `lora_base`), which a follower's `poll` hands back in the
  version's meta on either path. `unavailable`: why the direct channel asked for does not run (in
  `describe`, and `fleet/direct_unavailable` in `report`).
  """

  def __init__(
    self,
    root: str,
    keep: int,
    version: int,
    cast: Callable = _as_is,
    *,
    identity: identity_lib.Published | None = None,
    unavailable: str | None = None,
    meta: dict | None = None,
  ):
    self._disk = fleet.WeightPublisher(root, keep, version)
    self._cast, self._identity = cast, identity
    self._extra = dict(meta or {})
    self.unavailable = unavailable
    self.describe = f"checkpoints ({unavailable})" if unavailable else "checkpoints"

  def _meta(self, version: int) -> dict:
    """What a checkpoint of `version` carries besides the params."""
    ident = self._identity.identity(version).meta() if self._identity is not None else {}
    return {**self._extra, **ident}

  def _note(self, version: int, fingerprint: Callable[[], str]) -> dict:
    """Notes `version`'s fingerprint (when there is an identity); its seconds."""
    if self._identity is None:
      return {}
    t0 = time.time()
    self._identity.note(version, fingerprint())
    return {"fleet/fingerprint_s": time.time() - t0}

  def publish(self, params, version: int) -> dict:
    served = self._cast(params)
    out = self._note(version, lambda: identity_lib.fingerprint(served))
    self._disk.publish(served, version, self._meta(version))
    out["fleet/publish_s"] = self._disk.last_publish_s
    return out

  def report(self) -> dict:
    return {"fleet/direct_unavailable": 1} if self.unavailable else {}

  def close(self, finished: bool) -> None:
    del finished
    self._disk.close()  # the version in flight is complete on return


class DirectPublisher(CheckpointPublisher):
  """Every version served by `server` (weight_transfer.WeightServer), the
  cast inside its snapshot program (one pass over the params); every
  `checkpoint_every`-th version, the first and the last also checkpoints."""

  def __init__(
    self,
    root: str,
    keep: int,
    version: int,
    cast: Callable = _as_is,
    *,
    server: weight_transfer.WeightServer,
    checkpoint_every: int,
    identity: identity_lib.Published | None = None,
    meta: dict | None = None,
  ):
    super().__init__(root, keep, version, cast, identity=identity, meta=meta)
    self._server, self._every = server, checkpoint_every
    self._on_disk: int | None = None  # the newest version written as a checkpoint
    self._version = version
    self.describe = f"direct from {server.address}"

  def _meta(self, version: int) -> dict:
    return {"nonce": self._server.nonce, **super()._meta(version)}

  def publish(self, params, version: int) -> dict:
    s = self._server
    s.publish(
      params,
      version,
      self._cast,
      run_id=self._identity.run_id if self._identity is not None else None,
      meta=self._extra,
    )
    out = {"fleet/serve_s": s.last_publish_s}
    delta = s.last_delta  # this version's delta from the one before
    if delta:
      out["fleet/delta_changed_fraction"] = delta["changed"] / max(delta["blocks"], 1)
      out["fleet/delta_bytes_fraction"] = delta["bytes"] / max(delta["full_bytes"], 1)
      out["fleet/delta_s"] = delta["seconds"]
    out.update(self._note(version, lambda: s.fingerprint))
    if self._on_disk is None or version % self._every == 0:
      # The snapshot: fresh buffers (the train step donates `params`).
      self._disk.publish(s.snapshot, version, self._meta(version))
      self._on_disk = version
      out["fleet/publish_s"] = self._disk.last_publish_s
    self._version = version
    return out

  def report(self) -> dict:
    s = self._server
    return {
      "fleet/pulls_served": s.served,
      "fleet/delta_pulls_served": s.served_deltas,
      "fleet/pull_requests_refused": sum(s.refused.values()),
    }

  def close(self, finished: bool) -> None:
    if finished and self._on_disk != self._version:
      # The last version on disk too: rollouts still pulling it when the
      # servers go take it from there.
      self._disk.publish(self._server.snapshot, self._version, self._meta(self._version))
    super().close(finished)
    self._server.close()  # manifests withdrawn: what is left is on disk


def _checkpoint_publisher(
  root: str,
  f: sections.Fleet,
  version: int,
  cast: Callable,
  *,
  identity: identity_lib.Published | None,
  share: Callable,
  meta: dict | None = None,
) -> CheckpointPublisher:
  del share
  return CheckpointPublisher(root, f.keep_versions, version, cast, identity=identity, meta=meta)


def _direct_publisher(
  root: str,
  f: sections.Fleet,
  version: int,
  cast: Callable,
  *,
  identity: identity_lib.Published | None,
  share: Callable,
  meta: dict | None = None,
) -> CheckpointPublisher:
  """A DirectPublisher, or checkpoints alone (saying why) where the transfer
  library is unavailable or the server does not start."""
  why = weight_transfer.unavailable()
  if why is None:
    # One name for this trainer run on all its processes: a version's
    # identity (a restarted trainer's republished versions are others).
    nonce = share("fleet_weights_nonce", lambda: f"{time.time():.6f}.{os.getpid()}")
    try:
      server = weight_transfer.WeightServer(
        root,
        nonce,
        host=f.transfer_host,
        sockets=f.transfer_sockets,
        poll_seconds=f.poll_seconds,
        pull_timeout_s=f.pull_timeout_s,
        delta_block=weight_delta.BLOCK if f.delta_versions else None,
      )
    except Exception as e:  # noqa: BLE001  # e.g. an address not ours
      why = f"the weight server did not start: {e!r}"[:300]
    else:
      return DirectPublisher(
        root,
        f.keep_versions,
        version,
        cast,
        server=server,
        checkpoint_every=f.checkpoint_every,
        identity=identity,
        meta=meta,
      )
  return CheckpointPublisher(
    root, f.keep_versions, version, cast, identity=identity, unavailable=why, meta=meta
  )


# ----------------------------------------------------------------- rollout side
def _checkpoint_follower(
  root: str, rollout_id: str, abstract_params, f: sections.Fleet, log: Callable[[str], None]
) -> fleet.WeightFollower:
  del rollout_id, f, log
  return fleet.WeightFollower(root, abstract_params)


def _direct_follower(
  root: str, rollout_id: str, abstract_params, f: sections.Fleet, log: Callable[[str], None]
) -> weight_transfer.Follower:
  """Pulls (weight_transfer.Follower), checkpoints behind them; where the
  transfer library is unavailable or the puller does not start, checkpoints
  alone, the reason logged and counted (`fallbacks["unavailable"]`)."""
  checkpoints = fleet.WeightFollower(root, abstract_params)
  why = weight_transfer.unavailable()
  if why is None:
    try:
      net = weight_transfer.NetFollower(
        root,
        rollout_id,
        checkpoints.abstract,
        host=f.transfer_host,
        sockets=f.transfer_sockets,
        pull_timeout_s=f.pull_timeout_s,
        delta=f.delta_versions,
      )
      return weight_transfer.Follower(checkpoints, net, log)
    except Exception as e:  # noqa: BLE001
      why = f"the transfer server did not start: {e!r}"[:300]
  log(f"[rollout {rollout_id}] weights from checkpoints only: {why}")
  follower = weight_transfer.Follower(checkpoints, None, log)
  follower.fallbacks["unavailable"] += 1
  return follower


def _checkpoint_counts(follower: fleet.WeightFollower) -> dict:
  del follower
  return dict(weights_path="checkpoint", pulls=0, pull_failures={})


def _direct_counts(follower: weight_transfer.Follower) -> dict:
  """Direct pulls, failures and fallbacks by reason, pulls and bytes whole /
  as deltas."""
  return dict(
    weights_path="direct",
    pulls=follower.pulls,
    pull_failures=dict(follower.failures),
    fallbacks=dict(follower.fallbacks),
    ignored_manifests=dict(follower.ignored_manifests),
    **follower.pull_counts(),
  )


def _check_direct(f: sections.Fleet) -> None:
  """The servers' address: an IP literal (the transfer library takes
  "ip:port"), so a host name fails at validation, not at the first publish."""
  if f.transfer_host:
    import ipaddress

    try:
      ipaddress.ip_address(f.transfer_host)
    except ValueError:
      sections.fail(
        "fleet.transfer_host",
        f.transfer_host,
        "an IP address (the hosts' internal interface) or \"\" with fleet.weights_path = 'direct'",
      )


# ----------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class WeightChannel:
  """One `fleet.weights_path`.

  Attributes:
    publisher: (root, fleet section, version, cast, *, identity, share,
      meta) -> the trainer's publisher (module docstring). `cast` takes the
      params to what the engines hold; `identity` an identity.Published or
      None; `meta` what each version carries besides (a dict or None);
      `share(key, make)` one value for all the trainer's processes
      (distributed.share_from_primary).
    follower: (root, rollout id, abstract params, fleet section, log) -> a
      rollout's follower (module docstring); `log` takes its lines.
    counts: follower -> its counters for the rollout worker's result
      (`weights_path`, `pulls`, `pull_failures`, more where it has them).
    check: raises ConfigError (one line) on a fleet section this channel
      cannot run with.
    device_buffers: whether a version in transit occupies device memory on
      both sides (the served copy on the trainer's chips, the pulled one on
      the engine's), which a pod's memory fit must count.
  """

  publisher: Callable[..., Any]
  follower: Callable[..., Any]
  counts: Callable[[Any], dict]
  check: Callable[[sections.Fleet], None] = lambda f: None
  device_buffers: bool = False


CHANNELS: dict[str, WeightChannel] = {
  "checkpoint": WeightChannel(_checkpoint_publisher, _checkpoint_follower, _checkpoint_counts),
  "direct": WeightChannel(
    _direct_publisher, _direct_follower, _direct_counts, check=_check_direct, device_buffers=True
  ),
}


def check_fleet_section(f: sections.Fleet) -> None:
  """ConfigError (one line) unless `fleet.weights_path` names a channel of
  `CHANNELS` that can run with the section (sections.py checks it is a name)."""
  if f.weights_path not in CHANNELS:
    sections.fail(
      "fleet.weights_path",
      f.weights_path,
      f"one of {', '.join(CHANNELS)} (sao_jax/transport/weight_channel.py)",
    )
  CHANNELS[f.weights_path].check(f)


def make_publisher(
  root: str,
  f: sections.Fleet,
  version: int,
  cast: Callable = _as_is,
  *,
  identity: identity_lib.Published | None = None,
  share: Callable = lambda key, make: make(),
  meta: dict | None = None,
):
  """The trainer's publisher of the channel `f.weights_path` names."""
  return CHANNELS[f.weights_path].publisher(
    root, f, version, cast, identity=identity, share=share, meta=meta
  )


def make_follower(
  root: str,
  rollout_id: str,
  abstract_params,
  f: sections.Fleet,
  log: Callable[[str], None] = _print,
):
  """A rollout's follower of the channel `f.weights_path` names."""
  return CHANNELS[f.weights_path].follower(root, rollout_id, abstract_params, f, log)


def follower_counts(follower, f: sections.Fleet) -> dict:
  """`follower`'s counters, as the channel `f.weights_path` names counts them."""
  return CHANNELS[f.weights_path].counts(follower)
