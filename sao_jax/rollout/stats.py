"""The rollout driver's counters: `DriverStats`.

A unit of its own because it is the driver's whole reporting surface: the
trainer's sources add it into their reports (train/sources.py), a fleet
shard carries some of its counters beside the shard (transport/fleet.py), and
the driver's parts that count (the episode loop in rollout/driver.py, page
admission in rollout/admission.py) all write into one instance. It is plain
data, read while the driver may run, so it imports nothing of the driver.
"""

from __future__ import annotations

import collections
import dataclasses

# `DriverStats.env_faults` keys of prompts skipped at admission: `env.task`
# failed or gave an unusable task, or `env.episode` failed.
ADMISSION_FAULTS = ("task_error", "episode_error")
# How many fault messages `DriverStats.env_fault_log` keeps (the latest): enough
# to diagnose, bounded so that a systematically failing environment cannot
# grow the driver's memory.
FAULT_LOG_SIZE = 16


@dataclasses.dataclass
class DriverStats:
  """What one `RolloutDriver` did, cumulative since it was built."""

  steps: int = 0
  prefill_steps: int = 0
  decode_steps: int = 0
  generated_tokens: int = 0
  finished: int = 0
  param_swaps: int = 0
  env_wait_seconds: float = 0.0
  # Seconds from dispatching an engine call to holding its results on the
  # host (device time plus transfer, less the host work overlapped with it).
  generate_seconds: float = 0.0
  # Decode-loop iterations run (one token for each decoding slot each).
  decode_iterations: int = 0
  # Environment faults by reason: the ENV_FAULTS keys count emitted (zero
  # reward) trajectories, the ADMISSION_FAULTS keys count skipped prompts,
  # "grader_error" counts graders that failed (GraderError), "env_stuck"
  # timeouts while more than max_stuck_env_steps steps were stuck.
  env_faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # "<reason> prompt <id> ...: <message>" of the latest faults, for logs.
  env_fault_log: collections.deque = dataclasses.field(
    default_factory=lambda: collections.deque(maxlen=FAULT_LOG_SIZE)
  )
  # Observations cut to `max_observation_chars`, or tool output cut to
  # `max_tool_output_tokens`; not a fault, the episode goes on.
  observations_truncated: int = 0
  # Malformed tool calls by reason (chat.ParsedTurn.errors, chat.validate_call):
  # the episode goes on, the environment answers with an error.
  tool_call_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # Well-formed tool calls handed to the environment (the valid-call rate is
  # tool_calls / (tool_calls + sum(tool_call_errors))).
  tool_calls: int = 0
  # What environments report in `StepResult.info["events"]` (e.g. a verifier
  # timeout), by name.
  env_events: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # A paged engine's: passes where an admission or a slot waited for pages,
  # and slots preempted (pages returned, record re-fed) to unblock a group.
  page_waits: int = 0
  preemptions: int = 0
  # Episodes run again from their prompt after a grader_error (not emitted).
  reruns: int = 0

  def count_fault(self, reason: str, where: str, detail: str) -> None:
    """One environment fault: counted by `reason`, its message kept in the log."""
    self.env_faults[reason] += 1
    self.env_fault_log.append(f"{reason} {where}: {detail}")
