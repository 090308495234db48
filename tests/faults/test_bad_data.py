"""Bad data on the way to the trainer: refused with a counted reason, never a crash.

Covers the in-process path (trajectory.checked, TrajectoryQueue) and the
store (hostile records, corrupt shards, the atomic writer). Nothing here
waits on a clock: the killed-writer test synchronises on a pipe.
"""

import collections
import dataclasses
import io
import os
import re
import signal
import struct
import subprocess
import sys
import tracemalloc
import zipfile

import numpy as np
import pytest
from array_record.python import array_record_module

from sao_jax.data import store
from sao_jax.data.ingestion import TrajectoryQueue
from sao_jax.data.store import CorruptRecordError, NoValidTrajectoriesError
from sao_jax.data.trajectory import (
  FINISH_REASONS,
  REJECT_REASONS,
  Trajectory,
  canonicalize,
  checked,
  validate,
)

VOCAB, MAX_LEN = 32, 64
WRAP = 2**32  # an int64 value + WRAP wraps back to the value in int32


def good(**changes) -> Trajectory:
  """P P a a o a a a o: two turns, reward on the last action token."""
  mask = np.array([0, 0, 1, 1, 0, 1, 1, 1, 0], bool)
  rewards = np.zeros(9, np.float32)
  rewards[7] = 1.0
  t = Trajectory(
    tokens=np.arange(1, 10, dtype=np.int32),
    action_mask=mask,
    rollout_logprobs=np.where(mask, -0.5, 0).astype(np.float32),
    policy_version=np.where(mask, 2, -1).astype(np.int32),
    rewards=rewards,
    turn_starts=np.array([2, 5], np.int32),
    prompt_id=3,
    group_id=1,
    finish_reason="done",
    start_time=1.0,
    end_time=2.0,
    env_seconds=0.5,
  )
  return dataclasses.replace(t, **changes)


def at(field, index, value, dtype=None):
  """A mutation: `field` (cast to `dtype` first) with [index] = value."""

  def mutate(t):
    a = getattr(t, field).astype(dtype or getattr(t, field).dtype)
    a[index] = value
    return dataclasses.replace(t, **{field: a})

  return mutate


def setf(**changes):
  return lambda t: dataclasses.replace(t, **changes)


def cast(field, dtype):
  return lambda t: dataclasses.replace(t, **{field: getattr(t, field).astype(dtype)})


def reshape2d(field):
  return lambda t: dataclasses.replace(t, **{field: getattr(t, field)[None]})


def truncate_all(n):
  return lambda t: dataclasses.replace(
    t,
    **{
      f: getattr(t, f)[:n]
      for f in ("tokens", "action_mask", "rollout_logprobs", "policy_version", "rewards")
    },
    turn_starts=t.turn_starts[:0] if n == 0 else t.turn_starts,
  )


def extend_to(n):
  def mutate(t):
    pad = n - len(t)
    return dataclasses.replace(
      t,
      tokens=np.concatenate([t.tokens, np.ones(pad, np.int32)]),
      action_mask=np.concatenate([t.action_mask, np.zeros(pad, bool)]),
      rollout_logprobs=np.concatenate([t.rollout_logprobs, np.zeros(pad, np.float32)]),
      policy_version=np.concatenate([t.policy_version, np.full(pad, -1, np.int32)]),
      rewards=np.concatenate([t.rewards, np.zeros(pad, np.float32)]),
    )

  return mutate


CASES = {
  # structure
  "tokens_list": (setf(tokens=list(range(1, 10))), "not_numpy"),
  "turn_starts_list": (setf(turn_starts=[2, 5]), "not_numpy"),
  "tokens_2d": (reshape2d("tokens"), "bad_rank"),
  "tokens_0d": (setf(tokens=np.array(3)), "bad_rank"),
  "mask_2d": (reshape2d("action_mask"), "bad_rank"),
  "logprobs_2d": (reshape2d("rollout_logprobs"), "bad_rank"),
  "version_2d": (reshape2d("policy_version"), "bad_rank"),
  "rewards_2d": (reshape2d("rewards"), "bad_rank"),
  "turn_starts_2d": (reshape2d("turn_starts"), "bad_rank"),
  "short_rewards": (lambda t: dataclasses.replace(t, rewards=t.rewards[:-1]), "length_mismatch"),
  "empty": (truncate_all(0), "empty"),
  "too_long": (extend_to(MAX_LEN + 1), "too_long"),
  # tokens
  "float_tokens": (cast("tokens", np.float64), "bad_token_dtype"),
  "fractional_tokens": (at("tokens", 0, 1.5, np.float32), "bad_token_dtype"),
  "bool_tokens": (cast("tokens", bool), "bad_token_dtype"),
  "token_negative": (at("tokens", 0, -1), "token_out_of_vocab"),
  "token_past_vocab": (at("tokens", 3, VOCAB), "token_out_of_vocab"),
  "token_wraps_in_int32": (at("tokens", 3, WRAP + 4, np.int64), "token_out_of_vocab"),
  "token_uint64_huge": (at("tokens", 3, 2**63 + 4, np.uint64), "token_out_of_vocab"),
  # mask
  "int_mask": (cast("action_mask", np.int32), "bad_mask_dtype"),
  "uint8_mask": (cast("action_mask", np.uint8), "bad_mask_dtype"),
  "float_mask": (cast("action_mask", np.float32), "bad_mask_dtype"),
  "no_actions": (setf(action_mask=np.zeros(9, bool)), "no_action_tokens"),
  "action_first": (at("action_mask", 0, True), "action_without_prompt"),
  # log-probs
  "str_logprobs": (cast("rollout_logprobs", "U8"), "bad_logprob_dtype"),
  "complex_logprobs": (cast("rollout_logprobs", np.complex64), "bad_logprob_dtype"),
  "object_logprobs": (cast("rollout_logprobs", object), "bad_logprob_dtype"),
  "bool_logprobs": (cast("rollout_logprobs", bool), "bad_logprob_dtype"),
  "nan_logprob": (at("rollout_logprobs", 2, np.nan), "nonfinite_rollout_logprobs"),
  "inf_logprob": (at("rollout_logprobs", 2, -np.inf), "nonfinite_rollout_logprobs"),
  # finite in float64, -inf once cast to the float32 the trainer uses
  "logprob_overflows_float32": (
    at("rollout_logprobs", 2, -1e39, np.float64),
    "nonfinite_rollout_logprobs",
  ),
  "positive_logprob": (at("rollout_logprobs", 2, 0.5), "positive_logprob"),
  "logprob_off_action": (at("rollout_logprobs", 4, -0.1), "logprob_off_action"),
  # policy version
  "float_version": (cast("policy_version", np.float32), "bad_version_dtype"),
  "version_wraps_in_int32": (at("policy_version", 2, WRAP + 2, np.int64), "bad_policy_version"),
  "negative_version": (at("policy_version", 2, -3), "bad_policy_version"),
  "version_off_action": (at("policy_version", 0, 0), "bad_policy_version"),
  # rewards
  "bool_rewards": (cast("rewards", bool), "bad_reward_dtype"),
  "str_rewards": (cast("rewards", "U8"), "bad_reward_dtype"),
  "nan_reward": (at("rewards", 7, np.nan), "nonfinite_rewards"),
  "reward_overflows_float32": (at("rewards", 7, 1e39, np.float64), "nonfinite_rewards"),
  "reward_off_action": (at("rewards", 0, 1.0), "reward_off_action"),
  # turn starts
  "float_turn_starts": (cast("turn_starts", np.float64), "bad_turn_starts_dtype"),
  "bool_turn_starts": (setf(turn_starts=np.array([True])), "bad_turn_starts_dtype"),
  "no_turns": (setf(turn_starts=np.zeros(0, np.int32)), "missing_first_turn_start"),
  "first_turn_missed": (setf(turn_starts=np.array([5], np.int32)), "missing_first_turn_start"),
  "turn_past_end": (setf(turn_starts=np.array([2, 9], np.int32)), "turn_start_out_of_range"),
  "negative_turn": (setf(turn_starts=np.array([-1, 2], np.int32)), "turn_start_out_of_range"),
  "turn_wraps_in_int32": (at("turn_starts", 1, WRAP + 5, np.int64), "turn_start_out_of_range"),
  "turns_decreasing": (setf(turn_starts=np.array([5, 2], np.int32)), "turn_starts_not_increasing"),
  "turns_repeated": (setf(turn_starts=np.array([2, 2], np.int32)), "turn_starts_not_increasing"),
  "turn_on_observation": (setf(turn_starts=np.array([2, 4], np.int32)), "turn_start_off_action"),
  "turn_on_prompt": (setf(turn_starts=np.array([1, 2], np.int32)), "turn_start_off_action"),
  "more_turns_than_actions": (
    setf(turn_starts=np.array([2, 3, 5, 6, 7, 8], np.int32)),
    "too_many_turns",
  ),
  # scalars
  "float_prompt_id": (setf(prompt_id=3.0), "bad_prompt_id"),
  "str_prompt_id": (setf(prompt_id="3"), "bad_prompt_id"),
  "bool_prompt_id": (setf(prompt_id=True), "bad_prompt_id"),
  "none_prompt_id": (setf(prompt_id=None), "bad_prompt_id"),
  "huge_prompt_id": (setf(prompt_id=2**70), "bad_prompt_id"),
  "float_group_id": (setf(group_id=1.5), "bad_group_id"),
  "unknown_finish": (setf(finish_reason="??"), "bad_finish_reason"),
  "int_finish": (setf(finish_reason=7), "bad_finish_reason"),
  "nan_start_time": (setf(start_time=float("nan")), "bad_time"),
  "inf_end_time": (setf(end_time=float("inf")), "bad_time"),
  "str_env_seconds": (setf(env_seconds="0.5"), "bad_time"),
  "time_overflows_float": (setf(end_time=10**400), "bad_time"),
  # routing replay's record (its missing_routing needs a consumer that
  # replays: tests/rollout/test_routing_replay.py)
  "routing_not_per_token": (setf(routing=np.zeros((8, 1, 2), np.int16)), "bad_routing"),
  "routing_rank_2": (setf(routing=np.zeros((9, 2), np.int16)), "bad_routing"),
  "routing_float": (setf(routing=np.zeros((9, 1, 2), np.float32)), "bad_routing"),
  "routing_below_none": (setf(routing=np.full((9, 1, 2), -2, np.int32)), "routing_out_of_range"),
  "routing_past_int16": (setf(routing=np.full((9, 1, 2), 2**15, np.int32)), "routing_out_of_range"),
  # identity (sao_jax/data/identity.py)
  "run_id_not_str": (setf(run_id=7), "bad_run_id"),
  "run_id_with_slash": (setf(run_id="../run"), "bad_run_id"),
  "fingerprints_not_dict": (setf(fingerprints=["0123456789abcdef"]), "bad_fingerprints"),
  "fingerprint_not_hex": (setf(fingerprints={2: "not a fingerprint"}), "bad_fingerprints"),
  "fingerprint_key_not_int": (setf(fingerprints={"two": "0123456789abcdef"}), "bad_fingerprints"),
  "fingerprint_of_unused_version": (setf(fingerprints={3: "0123456789abcdef"}), "bad_fingerprints"),
}


def test_every_reason_is_a_snake_case_label_and_exercised():
  pattern = re.compile(r"^[a-z][a-z0-9_]*$")
  for reason in (
    REJECT_REASONS + store.RECORD_REASONS + store.SHARD_REASONS + ("stale", "validation_error")
  ):
    assert pattern.match(reason) and len(reason) <= 32, reason
  exercised = {r for _, r in CASES.values()} | {"version_from_future", "missing_routing"}
  assert exercised == set(REJECT_REASONS)
  assert {"env_error", "env_timeout", "env_garbage"} <= set(FINISH_REASONS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_field_is_rejected_with_its_reason(name):
  mutate, reason = CASES[name]
  assert validate(good(), VOCAB, MAX_LEN) is None
  assert validate(mutate(good()), VOCAB, MAX_LEN) == reason
  assert checked(mutate(good()), VOCAB, MAX_LEN) == (None, reason)


def test_version_from_future():
  assert validate(good(), VOCAB, MAX_LEN, current_version=2) is None
  assert validate(good(), VOCAB, MAX_LEN, current_version=1) == "version_from_future"


def test_queue_counts_every_reason_and_never_raises():
  q = TrajectoryQueue(len(CASES) + 4, VOCAB, MAX_LEN, lambda: 10)
  for mutate, _ in CASES.values():
    assert q.put(mutate(good())) is False
  expected = collections.Counter(r for _, r in CASES.values())
  assert q.rejected == expected and q.accepted == 0 and q.qsize() == 0

  class Hostile:  # an object whose own attribute access raises
    @property
    def tokens(self):
      raise RuntimeError("boom")

  assert q.put(Hostile()) is False
  assert q.put("not a trajectory") is False
  assert q.rejected["validation_error"] == 1 and "RuntimeError" in q.last_error
  assert q.rejected["not_numpy"] == expected["not_numpy"] + 1


def test_queue_enqueues_the_canonical_copy():
  """Wide dtypes and numpy scalars go in; exactly the trainer's types come out,
  in a copy the producer can no longer change."""
  t = good(
    tokens=np.arange(1, 10, dtype=np.int64),
    rollout_logprobs=good().rollout_logprobs.astype(np.float64),
    policy_version=good().policy_version.astype(np.int64),
    rewards=good().rewards.astype(np.float16),
    turn_starts=good().turn_starts.astype(np.uint64),
    prompt_id=np.int64(3),
    group_id=np.int32(1),
    finish_reason=np.str_("env_timeout"),
    start_time=np.float64(1.0),
    end_time=2,
    env_seconds=np.float32(0.5),
  )
  q = TrajectoryQueue(4, VOCAB, MAX_LEN, lambda: 10)
  assert q.put(t)
  t.rewards[7] = np.inf  # the producer reuses its buffer after put
  t.tokens[0] = 10**6
  out = q.get(timeout=0)
  dtypes = {
    f: getattr(out, f).dtype
    for f in (
      "tokens",
      "action_mask",
      "rollout_logprobs",
      "policy_version",
      "rewards",
      "turn_starts",
    )
  }
  assert dtypes == {
    "tokens": np.int32,
    "action_mask": np.bool_,
    "rollout_logprobs": np.float32,
    "policy_version": np.int32,
    "rewards": np.float32,
    "turn_starts": np.int32,
  }
  assert [
    type(getattr(out, f))
    for f in ("prompt_id", "group_id", "finish_reason", "start_time", "end_time", "env_seconds")
  ] == [int, int, str, float, float, float]
  assert out.rewards[7] == 1.0 and out.tokens[0] == 1
  assert validate(out, VOCAB, MAX_LEN) is None


def test_canonicalize_accepts_a_subclass_and_returns_plain_arrays():
  t = good(tokens=np.ma.masked_array(good().tokens))
  c = canonicalize(t)
  assert type(c.tokens) is np.ndarray and c.tokens.dtype == np.int32


# --- records ------------------------------------------------------------------


def zip_of(members: dict[str, bytes], compression=zipfile.ZIP_STORED) -> bytes:
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w", compression) as zf:
    for name, data in members.items():
      zf.writestr(name, data)
  return buf.getvalue()


def members_of(record: bytes) -> dict[str, bytes]:
  with zipfile.ZipFile(io.BytesIO(record)) as zf:
    return {n: zf.read(n) for n in zf.namelist()}


def npy(a: np.ndarray, allow_pickle=False) -> bytes:
  buf = io.BytesIO()
  np.lib.format.write_array(buf, a, allow_pickle=allow_pickle)
  return buf.getvalue()


def npy_header(shape, descr="<i8") -> bytes:
  buf = io.BytesIO()
  np.lib.format.write_array_header_1_0(
    buf, {"descr": descr, "fortran_order": False, "shape": shape}
  )
  return buf.getvalue()


def with_member(name: str, data: bytes, record=None) -> bytes:
  members = members_of(record or store.serialize(good()))
  members[name] = data
  return zip_of(members)


def test_numpy_scalars_round_trip_through_the_store():
  t = good(
    prompt_id=np.int64(7),
    group_id=np.int32(2),
    finish_reason=np.str_("env_error"),
    start_time=np.float64(1.5),
    end_time=np.float32(2.5),
    env_seconds=np.int64(1),
  )
  back = store.deserialize(store.serialize(t))
  assert back.prompt_id == 7 and type(back.prompt_id) is int
  assert (back.group_id, back.finish_reason, back.start_time) == (2, "env_error", 1.5)
  c, reason = checked(back, VOCAB, MAX_LEN)
  assert reason is None
  for f in (
    "tokens",
    "action_mask",
    "rollout_logprobs",
    "policy_version",
    "rewards",
    "turn_starts",
  ):
    np.testing.assert_array_equal(getattr(c, f), getattr(t, f))


def test_serialize_refuses_object_arrays():
  with pytest.raises(ValueError, match="never pickles"):
    store.serialize(good(rewards=good().rewards.astype(object)))


def bomb_member(nbytes: int) -> tuple[bytes, int]:
  """A deflated tokens.npy of `nbytes` zeros, streamed (never held whole)."""
  buf = io.BytesIO()
  chunk = bytes(1 << 20)
  with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
    with zf.open("tokens.npy", "w") as f:
      f.write(npy_header((nbytes // 8,)))
      for _ in range(nbytes // len(chunk)):
        f.write(chunk)
  return buf.getvalue(), nbytes


def bomb_record(nbytes: int) -> bytes:
  """A good record whose tokens member inflates to `nbytes`."""
  bomb, _ = bomb_member(nbytes)
  members = members_of(store.serialize(good()))
  del members["tokens.npy"]
  buf = io.BytesIO(bomb)
  with zipfile.ZipFile(buf, "a", zipfile.ZIP_DEFLATED) as zf:
    for name, data in members.items():
      zf.writestr(name, data)
  return buf.getvalue()


@pytest.fixture
def no_decompression(monkeypatch):
  """Fails the test if any zip member is opened for reading."""
  opened = []
  real_open = zipfile.ZipFile.open

  def spy(self, name, mode="r", *args, **kwargs):
    if mode == "r":
      opened.append(getattr(name, "filename", name))
    return real_open(self, name, mode, *args, **kwargs)

  monkeypatch.setattr(zipfile.ZipFile, "open", spy)
  return opened


def test_savez_compressed_bomb_is_refused_before_decompressing(no_decompression):
  buf = io.BytesIO()
  t = good()
  np.savez_compressed(
    buf,
    header=np.frombuffer(b'{"prompt_id": 1}', np.uint8),
    tokens=np.zeros(1 << 22, np.int64),  # 32 MiB of zeros
    **{
      f: getattr(t, f)
      for f in ("action_mask", "rollout_logprobs", "policy_version", "rewards", "turn_starts")
    },
  )
  record = buf.getvalue()
  assert len(record) < 64 << 10  # small on disk
  no_decompression.clear()
  tracemalloc.start()
  try:
    with pytest.raises(CorruptRecordError, match="tokens.npy declares 33554560 bytes") as e:
      store.deserialize(record, max_length=4096)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert e.value.reason == "member_too_large"
  assert no_decompression == []  # the cap held before a byte was inflated
  assert peak < 4 << 20


def test_streamed_zip_bomb_is_refused_without_allocating(no_decompression):
  record = bomb_record(64 << 20)  # 64 MiB declared, ~64 KiB on disk
  assert len(record) < 128 << 10
  no_decompression.clear()
  tracemalloc.start()
  try:
    with pytest.raises(CorruptRecordError) as e:
      store.deserialize(record, max_length=8192)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert e.value.reason == "member_too_large" and "cap" in str(e.value)
  assert no_decompression == [] and peak < 4 << 20


def test_member_lying_about_its_size_reads_no_further_than_declared():
  """The central directory claims 1000 bytes for a member that inflates to
  64 MiB: reading stops at 1000 bytes and the CRC check refuses it."""
  record = bytearray(bomb_record(64 << 20))
  pos = record.find(b"PK\x01\x02")  # the first central entry: tokens.npy
  assert record[pos + 46 : pos + 46 + 10] == b"tokens.npy"
  struct.pack_into("<I", record, pos + 24, 1000)  # uncompressed size
  tracemalloc.start()
  try:
    with pytest.raises(CorruptRecordError) as e:
      store.deserialize(bytes(record), max_length=8192)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert e.value.reason == "corrupt_zip" and peak < 8 << 20


def test_npy_header_declaring_a_huge_shape_is_refused_before_allocation():
  record = with_member("tokens.npy", npy_header((10**12,)) + bytes(8))
  tracemalloc.start()
  try:
    with pytest.raises(CorruptRecordError) as e:
      store.deserialize(record)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert e.value.reason == "size_mismatch" and peak < 4 << 20


@pytest.mark.parametrize(
  "make,reason",
  [
    (lambda: b"", "not_npz"),
    (lambda: np.random.default_rng(0).bytes(2000), "not_npz"),
    (lambda: "a str", "not_bytes"),
    # Over the whole-record cap at the default max_length (6 arrays, and a
    # routing record of 384 choices a token: ~53 MB).
    (lambda: bytes(10**8), "record_too_large"),
    (
      lambda: zip_of(
        {k: v for k, v in members_of(store.serialize(good())).items() if k != "turn_starts.npy"}
      ),
      "bad_members",
    ),
    (lambda: with_member("evil.npy", npy(np.zeros(3))), "bad_members"),
    (
      lambda: with_member("rewards.npy", npy(np.array([1, "x"], object), allow_pickle=True)),
      "pickled_object",
    ),
    (lambda: with_member("tokens.npy", npy(np.array(["a"] * 9))), "bad_array_dtype"),
    (lambda: with_member("tokens.npy", npy(np.zeros(9, "i4,i4"))), "bad_array_dtype"),
    (lambda: with_member("tokens.npy", b"\x93NUMPY garbage"), "bad_npy"),
    (lambda: with_member("tokens.npy", b"not npy at all"), "bad_npy"),
    (
      lambda: with_member("action_mask.npy", npy_header((9,), "|b1") + bytes([0, 0, 2] * 3)),
      "bad_npy",
    ),
    (lambda: with_member("tokens.npy", npy(np.arange(9, dtype=np.int32))[:-3]), "size_mismatch"),
    (lambda: with_member("header.npy", npy(np.frombuffer(b"{not json", np.uint8))), "bad_header"),
    (lambda: with_member("header.npy", npy(np.frombuffer(b"[1, 2]", np.uint8))), "bad_header"),
    (
      lambda: with_member(
        "header.npy", npy(np.frombuffer(b'{"prompt_id": 1, "evil": 2}', np.uint8))
      ),
      "bad_header",
    ),
    (
      lambda: with_member("header.npy", npy(np.frombuffer(b"[" * 3000 + b"]" * 3000, np.uint8))),
      "bad_header",
    ),
    (
      lambda: with_member("header.npy", npy(np.frombuffer(b'{"group_id": 1}', np.uint8))),
      "bad_header",
    ),
    (lambda: with_member("header.npy", npy(np.zeros(3, np.float32))), "bad_header"),
  ],
)
def test_hostile_record_is_refused_with_a_reason(make, reason):
  with pytest.raises(CorruptRecordError) as e:
    store.deserialize(make())
  assert e.value.reason == reason
  assert reason in store.RECORD_REASONS


def test_deserialized_values_are_validated_after_the_cast():
  """A record that is structurally fine but holds float64 rewards of 1e39."""
  rewards = good().rewards.astype(np.float64)
  rewards[7] = 1e39
  t = store.deserialize(store.serialize(good(rewards=rewards)))
  assert t.rewards.dtype == np.float64 and np.isfinite(t.rewards).all()
  assert checked(t, VOCAB, MAX_LEN) == (None, "nonfinite_rewards")


# --- shards -------------------------------------------------------------------


def write_shard(path, trajs):
  with store.TrajectoryWriter(str(path)) as w:
    for t in trajs:
      w.write(t)
  return str(path)


def write_raw_shard(path, records):
  w = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    w.write(r)
  w.close()
  return str(path)


def goods(n, start=0):
  return [good(prompt_id=i) for i in range(start, start + n)]


def test_shard_with_garbage_records_among_good_ones(tmp_path):
  bad_value = good(rollout_logprobs=np.where(good().action_mask, 0.5, 0).astype(np.float32))
  records = [store.serialize(t) for t in goods(3)]
  records[1:1] = [b"garbage", bomb_record(1 << 20), store.serialize(bad_value)]
  records.append(store.serialize(good(prompt_id=9, rewards=good().rewards.astype(np.float64))))
  path = write_raw_shard(tmp_path / "mixed.array_record", records)
  trajs, dropped = store.read_valid_trajectories([path], VOCAB, 16)
  assert [t.prompt_id for t in trajs] == [0, 1, 2, 9]
  assert all(t.rewards.dtype == np.float32 for t in trajs)  # canonical copies
  assert dropped == {"not_npz": 1, "member_too_large": 1, "positive_logprob": 1}


def test_truncated_random_and_missing_shards_are_counted_and_skipped(tmp_path):
  ok = write_shard(tmp_path / "ok.array_record", goods(4))
  data = open(ok, "rb").read()
  truncated = tmp_path / "truncated.array_record"
  truncated.write_bytes(data[: len(data) // 2])
  tiny = tmp_path / "tiny.array_record"
  tiny.write_bytes(data[:100])
  rand = tmp_path / "random.array_record"
  rand.write_bytes(np.random.default_rng(1).bytes(200_000))
  empty = tmp_path / "empty.array_record"
  empty.write_bytes(b"")
  paths = [str(p) for p in (truncated, tiny, rand, empty)] + [
    str(tmp_path / "missing.array_record"),
    str(tmp_path),
    ok,
  ]
  trajs, dropped = store.read_valid_trajectories(paths, VOCAB, MAX_LEN)
  assert [t.prompt_id for t in trajs] == [0, 1, 2, 3]
  assert dropped == {"corrupt_shard": 4, "missing_shard": 2}


def test_record_with_a_bad_hash_is_counted_and_the_others_kept(tmp_path):
  path = write_shard(tmp_path / "flip.array_record", goods(5))
  data = bytearray(open(path, "rb").read())
  data[80] ^= 0xFF  # inside the first record's chunk header (the chunk at byte 64)
  open(path, "wb").write(bytes(data))
  trajs, dropped = store.read_valid_trajectories([path], VOCAB, MAX_LEN)
  assert [t.prompt_id for t in trajs] == [1, 2, 3, 4]
  assert dropped == {"corrupt_record": 1}


def test_nothing_valid_left_raises_one_clear_error(tmp_path):
  bad = write_raw_shard(tmp_path / "bad.array_record", [b"x", b"y"])
  missing = str(tmp_path / "gone.array_record")
  with pytest.raises(NoValidTrajectoriesError, match="gone.array_record") as e:
    store.read_valid_trajectories([bad, missing], VOCAB, MAX_LEN)
  assert "not_npz': 2" in str(e.value) and "missing_shard': 1" in str(e.value)


def test_shuffle_is_a_seeded_permutation(tmp_path):
  path = write_shard(tmp_path / "s.array_record", goods(20))
  ids = lambda seed: [
    t.prompt_id for t in store.read_valid_trajectories([path], VOCAB, MAX_LEN, shuffle_seed=seed)[0]
  ]
  assert ids(3) == ids(3) and sorted(ids(3)) == list(range(20)) and ids(3) != ids(None)


def test_grain_reader_validates_too(tmp_path):
  path = write_raw_shard(
    tmp_path / "g.array_record", [store.serialize(good()), store.serialize(good(prompt_id=True))]
  )
  ds = store.read_trajectories([path], vocab_size=VOCAB, max_length=MAX_LEN)
  assert ds[0].tokens.dtype == np.int32
  with pytest.raises(CorruptRecordError, match="bad_prompt_id"):
    ds[1]


# --- the atomic writer ------------------------------------------------------------


def test_writer_publishes_only_on_close(tmp_path):
  path = str(tmp_path / "a.array_record")
  w = store.TrajectoryWriter(path)
  w.write(good())
  assert not os.path.exists(path) and os.path.exists(w.tmp_path)
  w.close()
  w.close()  # idempotent
  assert os.path.exists(path) and not os.path.exists(w.tmp_path)
  assert len(store.read_valid_trajectories([path], VOCAB, MAX_LEN)[0]) == 1


def test_writer_replaces_a_shard_whole_and_an_exception_keeps_the_old_one(tmp_path):
  path = write_shard(tmp_path / "r.array_record", goods(2))
  with pytest.raises(KeyError):
    with store.TrajectoryWriter(path) as w:
      w.write(good())
      raise KeyError("the driver failed")
  assert not os.path.exists(w.tmp_path)
  assert len(store.read_valid_trajectories([path], VOCAB, MAX_LEN)[0]) == 2
  with store.TrajectoryWriter(path) as w:
    w.write(good(prompt_id=42))
    assert len(store.read_valid_trajectories([path], VOCAB, MAX_LEN)[0]) == 2
  assert [t.prompt_id for t in store.read_valid_trajectories([path], VOCAB, MAX_LEN)[0]] == [42]


_KILLED_WRITER = """
import sys
import numpy as np
from sao_jax.data.store import TrajectoryWriter
from sao_jax.data.trajectory import Trajectory
mask = np.array([0, 1], bool)
t = Trajectory(np.array([1, 2], np.int32), mask, np.array([0, -1], np.float32),
               np.array([-1, 0], np.int32), np.zeros(2, np.float32), np.array([1], np.int32), 0)
w = TrajectoryWriter(sys.argv[1])
for _ in range(3):
  w.write(t)
print(w.tmp_path, flush=True)
sys.stdin.read()  # wait here, mid-write, until killed
"""


def test_writer_killed_before_close_leaves_no_shard(tmp_path):
  path = str(tmp_path / "killed.array_record")
  proc = subprocess.Popen(
    [sys.executable, "-c", _KILLED_WRITER, path],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    tmp = proc.stdout.readline().strip()  # the pipe, not a clock, says it has written
    assert tmp == f"{path}.tmp-{proc.pid}"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    proc.stdin.close()
    proc.stdout.close()
  assert not os.path.exists(path)
  with pytest.raises(NoValidTrajectoriesError, match="missing_shard"):
    store.read_valid_trajectories([path], VOCAB, MAX_LEN)


def test_reader_takes_one_path_too(tmp_path):
  path = write_shard(tmp_path / "one.array_record", goods(2))
  assert len(store.read_valid_trajectories(path, VOCAB, MAX_LEN)[0]) == 2
  assert len(store.read_valid_trajectories(tmp_path / "one.array_record", VOCAB, MAX_LEN)[0]) == 2
