"""A run: what the stages of training work on, built, then opened on a workdir.

    run = build(config)          # validates, builds models, mesh, programs and
                                 # the initial state; writes nothing
    open_workdir(run, workdir)   # checkpointer and metrics; restores the
                                 # latest checkpoint if there is one
    stages.STAGES[run.meta["stage"]](run)   # sao_jax/train/stages.py

`load(config, workdir)` does the first two. Tools (launch/serve.py,
launch/eval.py, the benchmarks) use this public API: `run.state.policy`,
`run.model_cfg`, `run.tok`, `run.env`, `run.engine(...)`, `run.evaluate(...)`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections

from sao_jax.config import sections
from sao_jax.data import files
from sao_jax.data.checkpoint import (
  Checkpointer,
  abstract_like,
  check_lora_base,
  committed_checkpoints,
  restore_policy,
)
from sao_jax.envs import base, registry
from sao_jax.models import config as model_config
from sao_jax.models import sharding
from sao_jax.models.lora import fingerprint as lora_fingerprint
from sao_jax.rollout.driver import RolloutDriver
from sao_jax.rollout.engine import PolicyEngine
from sao_jax.train import configuration, distributed, factories
from sao_jax.train.evaluation import evaluate_sets, fmt_number, set_environments
from sao_jax.train.faults import FaultInjector
from sao_jax.train.metrics import MetricsWriter
from sao_jax.train.train_step import StepConfig, TrainState


@dataclasses.dataclass
class Run:
  """Everything one run holds. `state` and `meta` change as the stages go."""

  config: sections.Sections  # the typed config (run.build loads the flags' ConfigDict)
  tok: Any
  format: Any  # the chat format (registry.make_format)
  env: Any
  # Evaluation and value pretraining must not advance an environment's own
  # clock (online_style's preference schedule): only training episodes do.
  frozen_env: Any
  faults: FaultInjector
  model_cfg: model_config.ModelConfig
  step_cfg: StepConfig
  mesh: jax.sharding.Mesh
  programs: factories.Programs
  rl_step: Any  # the programs' steps, in lockstep across processes
  value_step: Any
  sft_step: Any
  state: TrainState
  meta: dict
  workdir: str | None = None  # set by open_workdir, with ckpt and metrics
  ckpt: Checkpointer | None = None
  metrics: MetricsWriter | None = None
  eval_envs: dict | None = None  # eval.sets' environments by name (the first is reported flat)
  # LoRA: (policy base, critic base), the frozen params the state's adapters apply to.
  bases: Any = None

  def policy_params(self):
    """The policy's full params: `state.policy`, or with LoRA its base merged with
    the adapters (a new tree: what engines serve, evaluation and exports read)."""
    return factories.full_params(self.programs, self.bases, self.state.policy, "policy")

  def critic_params(self):
    """The critic's full params (`policy_params`' twin)."""
    return factories.full_params(self.programs, self.bases, self.state.critic, "critic")

  @property
  def rules(self):
    return self.programs.rules

  @property
  def batch_sharding(self):
    return self.programs.batch_sharding

  @property
  def routing_shape(self) -> tuple[int, int, int] | None:
    """(MoE layers, experts a token, experts) with `rl.routing_replay`, else None:
    what every RL trajectory must carry and the RL batch holds."""
    if not self.config.rl.routing_replay:
      return None
    c = self.model_cfg
    return (c.num_moe_layers, c.experts_per_token, c.num_experts)

  # --------------------------------------------------------------- checkpoints
  def save(self, force: bool = False) -> None:
    self.meta["ckpt_step"] += 1
    self.ckpt.save(self.meta["ckpt_step"], self.state, self.meta, force=force)

  def advance(self, stage: str) -> None:
    """The current stage is complete: checkpoint at the start of `stage`."""
    self.meta.update(stage=stage, stage_step=0)
    self.save(force=True)

  def close(self) -> None:
    try:
      if self.ckpt is not None:
        self.ckpt.close()  # raises CheckpointWriteError if the save in flight failed
    finally:
      if self.metrics is not None:
        self.metrics.close()

  # --------------------------------------------------------------- batches
  def put_batch(self, batch):
    """A whole packed numpy batch as global arrays (each process places its rows)."""
    return distributed.global_batch(batch, self.batch_sharding, len(batch["tokens"]))

  def pack(self, trajs, rows, baseline_advantages=None, policy_head=True):
    """The batch of `trajs` in `rows` rows, placed; this process builds only its own rows.

    `policy_head`: the step computes the policy's log-probs (SFT, RL), so
    with `data.logits_at_actions` the batch carries `action_index`; the
    value step reads none, and a batch without it compiles once per bucket.
    """
    return distributed.pack_batch(
      trajs,
      rows,
      self.config.data.buckets,
      self.batch_sharding,
      baseline_advantages,
      action_index=policy_head and self.config.data.logits_at_actions,
    )

  # --------------------------------------------------------------- rollout
  def engine(self, params, version: int, **kwargs) -> PolicyEngine:
    """A rollout engine on `params` (a global tree of the trainer's mesh).

    Colocated and sharded: with `rollout.sharded_engine` the engine lays params
    and KV cache out on the trainer's mesh (slots over the batch axes, kv
    heads over "tensor") and weight swaps reshard on device. Off by default on
    CPU, where one device serves the tiny model best. With several processes
    an engine is one host's: its devices, a local copy. `rollout.mesh` gives
    the engine a mesh of its own (`factories.engine_mesh`).
    """
    single = jax.process_count() == 1
    params = distributed.host_local_copy(params, self.mesh)  # collective on a global tree
    return factories.make_engine(
      self.config,
      self.model_cfg,
      params,
      version,
      mesh=self.mesh if single else None,
      devices=list(self.mesh.devices.flat) if single else jax.local_devices(),
      **kwargs,
    )

  def driver(
    self, engine: PolicyEngine, env, prompt_iter, emit, rollout=None, **options
  ) -> RolloutDriver:
    """A rollout driver (`factories.make_driver`): the engine's rollout section,
    or `rollout` (e.g. value pretraining's own samples and decode steps)."""
    return factories.make_driver(
      self.config, engine, env, self.tok, prompt_iter, emit, rollout, **options
    )

  def evaluate(self, name: str, params, out_dir: str | None = None) -> dict:
    """`eval.sets` pass@1 / pass@k of `params`, recorded in `meta["evals"][name]` and
    the metrics ("eval/<field>" for the first set, "eval/<set>/<field>" for
    each); every sample and each set's summary.json go to `out_dir`
    (default `<workdir>/eval/<name>`)."""
    params = distributed.host_local_copy(params, self.mesh)  # every process joins
    if out_dir is None and self.workdir is not None:
      out_dir = files.join(self.workdir, "eval", name)
    result = distributed.share_from_primary(
      f"eval/{name}",
      lambda: evaluate_sets(
        self.config,
        self.model_cfg,
        params,
        self.eval_envs,
        self.tok,
        seed=self.config.seed + 7,
        out_dir=out_dir,
      ),
    )
    self.meta["evals"][name] = result
    scalars = {f"eval/{k}": v for k, v in result.items() if _is_number(v)}
    for set_name, r in result["sets"].items():
      scalars.update({f"eval/{set_name}/{k}": v for k, v in r.items() if _is_number(v)})
    self.metrics.write(int(self.state.step), scalars, "eval")
    for set_name, r in result["sets"].items():
      verdicts = ", ".join(
        f"{k[len('verdict_') :]} {v:.2f}" for k, v in r.items() if k.startswith("verdict_")
      )
      print(
        f"[eval] {name} {set_name}: pass@1 {fmt_number(r['pass@1'])} on {r['tasks']} tasks "
        f"(mean {fmt_number(r['mean_turns'], 2)} turns, valid tool calls "
        f"{fmt_number(r.get('valid_tool_calls'), 2)}; verdicts: {verdicts or '-'})",
        flush=True,
      )
    return result


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def wait(tree):
  """Blocks until a sharded step has finished on every device.

  With several (simulated) devices on few CPU cores, XLA:CPU can deadlock in
  a collective's rendezvous when many multi-device programs are dispatched
  ahead; one step in flight at a time avoids it. The host loop needs each
  step's metrics anyway, so this costs no overlap worth having.
  """
  jax.block_until_ready(tree)


def initial_policy(config: sections.Sections, model_cfg, tok, p: factories.Programs, mesh):
  """The policy's params at step 0: `model.hf_dir`'s weights, read one tensor at
  a time into their shardings, else a random initialisation (the config's
  seed; the same values on any mesh); with `sft.init_from_run` that run's
  checkpointed policy. A LoRA run's fleet rollouts build their frozen base
  with this too (fleet_worker.py)."""
  if config.sft.init_from_run:
    return _policy_of_run(config.sft.init_from_run, model_cfg, p)
  hf_dir = config.model.hf_dir
  if not hf_dir:
    return sharding.sharded_init(p.policy_init, mesh, p.rules)[0]
  if tok.vocab_size > model_cfg.vocab_size:
    raise configuration.ConfigError(
      f"model.hf_dir = {hf_dir!r}: its vocab_size {model_cfg.vocab_size} is smaller than "
      f"the run's tokenizer's ({tok.vocab_size}); set env.tokenizer_path to its "
      "tokenizer.json"
    )
  from sao_jax.models import hf_import

  print(f"[model] {model_cfg.family} from {hf_dir}", flush=True)
  return hf_import.load_hf_checkpoint(hf_dir, model_cfg, p.policy_shardings)


def run_source(source: str) -> tuple[str, int, dict]:
  """`sft.init_from_run` ("DIR", its newest complete checkpoint, or "DIR@N",
  checkpoint N) resolved: (DIR, N, the checkpoint's meta); one line when
  there is no such checkpoint."""
  workdir, at, number = source.rpartition("@") if "@" in source else (source, "", "")
  if at and not number.isdigit():
    raise configuration.ConfigError(
      f"sft.init_from_run = {source!r}: a run directory, or DIR@N for its checkpoint N"
    )
  where = files.join(workdir, "checkpoints")
  found = committed_checkpoints(where)
  step = int(number) if at else max(found, default=None)
  if step not in found:
    raise configuration.ConfigError(
      f"sft.init_from_run = {source!r}: no complete checkpoint "
      f"{'' if step is None else step} under {where} (there are: {sorted(found) or 'none'})"
    )
  return workdir, step, found[step]


def _policy_of_run(source: str, model_cfg, p: factories.Programs):
  """The full-model policy of `sft.init_from_run`'s checkpoint (`run_source`),
  read into this run's policy shardings; one line when it holds LoRA
  adapters or another head."""
  workdir, step, meta = run_source(source)
  where = files.join(workdir, "checkpoints")
  why = None
  if meta.get("lora_base") is not None:
    why = (
      "it trained LoRA adapters; export its merged model (launch/export.py) and start "
      "from that with model.hf_dir"
    )
  elif meta.get("vocab_ids") != (list(model_cfg.vocab_ids) or None):
    why = "its head covers other token ids (another dataset or model.vocab_subset)"
  if why:
    raise configuration.ConfigError(
      f"sft.init_from_run = {workdir!r}: checkpoint {step} cannot start this run: {why}"
    )
  print(
    f"[model] the policy of {workdir} (checkpoint {step}, stage {meta.get('stage')} "
    f"step {meta.get('stage_step')})",
    flush=True,
  )
  try:
    return restore_policy(where, step, factories.abstract_full_policy(p))
  except ValueError as e:  # orbax's shape or tree mismatch: another model
    raise configuration.ConfigError(
      f"sft.init_from_run = {workdir!r}: checkpoint {step} holds another model than "
      f"this run's ({' '.join(str(e).split())[:300]})"
    ) from None


def pinned_source(source: str) -> str | None:
  """`sft.init_from_run` as "DIR@N", the checkpoint it resolves to now (None: unset)."""
  if not source:
    return None
  workdir, step, _ = run_source(source)
  return f"{workdir}@{step}"


def _carried_tensors(hf_dir: str) -> dict | None:
  """{"dir", "names"} of `hf_dir`'s MTP-head tensors, or None without any."""
  if not hf_dir:
    return None
  from sao_jax.models import hf_import

  names = hf_import.mtp_tensors(hf_dir)
  return {"dir": os.path.abspath(hf_dir), "names": names} if names else None


def build(config: ml_collections.ConfigDict | sections.Sections) -> Run:
  """A run at step 0 from its config: everything but the workdir. Writes nothing.

  Everything that can refuse the run (the config, an environment that would
  run code unisolated) does so here, before a workdir exists. The
  ConfigDict of the flags stops here: the run holds, and everything below
  reads, its typed sections (`Run.config`, a sections.Sections).
  """
  factories.validate_config(config)
  config = sections.load(config)
  if config.sft.init_from_run:  # resolved once: the checkpoint loaded is the one recorded
    config = config.replace(
      sft=config.sft.replace(init_from_run=pinned_source(config.sft.init_from_run))
    )
  tok = registry.make_tokenizer(config.env)
  env = registry.make_env(config.env)  # refuses unisolated code execution
  faults = FaultInjector(config.faults)
  model_cfg = factories.build_model_config(config, tok, env)
  step_cfg = factories.step_config(config)
  # Mesh, shardings, optimizers and steps (shapes first, then placement).
  mesh = sharding.make_mesh(dict(config.sharding.mesh))
  p = factories.build_programs(config, model_cfg, step_cfg, mesh)
  # Shapes only so far: what the memory present cannot hold fails before
  # the first allocation.
  configuration.check_memory(config, model_cfg, p.abstract_resident)
  rl_step, value_step, sft_step = (
    distributed.lockstep(f, name)
    for f, name in ((p.rl_step, "rl_step"), (p.value_step, "value_step"), (p.sft_step, "sft_step"))
  )
  policy_params = initial_policy(config, model_cfg, tok, p, mesh)
  critic_params, _ = sharding.sharded_init(p.critic_init, mesh, p.rules)
  state = jax.jit(p.init_state, out_shardings=p.state_shardings)(policy_params, critic_params)
  bases = factories.lora_bases(p, policy_params, critic_params)  # None without LoRA
  if bases is not None:  # the steps read the frozen bases as their last argument
    rl_step, value_step, sft_step = (
      factories.with_bases(f, bases) for f in (rl_step, value_step, sft_step)
    )
  meta = {
    "stage": "sft",
    "stage_step": 0,
    "ckpt_step": 0,
    "source": None,
    "estimator_state": {},
    "evals": {},
    # model.vocab_subset's head ids: a restore under other ids is refused.
    "vocab_ids": list(model_cfg.vocab_ids) or None,
    # What model.hf_dir holds that the run does not train (Qwen3.5's MTP
    # head): an export carries it over from there (trainer.export).
    "carried_tensors": _carried_tensors(config.model.hf_dir),
    # LoRA: the base the adapters were trained on (a resume on another is refused).
    "lora_base": None if bases is None else lora_fingerprint(bases[0]),
    # sft.init_from_run's checkpoint, pinned ("DIR@N": what a LoRA resume or
    # a fleet's rollouts must start from again).
    "init_from_run": config.sft.init_from_run or None,
  }
  frozen_env = base.frozen_view(env)
  return Run(
    config,
    tok,
    registry.make_format(config.env, tok),
    env,
    frozen_env,
    faults,
    model_cfg,
    step_cfg,
    mesh,
    p,
    rl_step,
    value_step,
    sft_step,
    state,
    meta,
    eval_envs=set_environments(config, frozen_env),
    bases=bases,
  )


def open_workdir(
  run: Run, workdir: str, restore_step: int | None = None, training: bool = False
) -> Run:
  """Attaches `workdir` (checkpoints, metrics) and restores its latest checkpoint.

  `restore_step`: that checkpoint instead of the latest. A workdir without a
  checkpoint leaves the run at step 0. Newer checkpoints than the newest
  that restores are damaged (truncated, files missing): each is skipped and
  logged, and when `training` (the run that writes this workdir, not a tool
  reading it) set aside and counted (`_restore_intact`).
  """
  config = run.config
  configuration.check_workdir(workdir, config.checkpoint.min_free_gb)
  if run.faults.active:
    print(f"[faults] injecting faults: {dataclasses.asdict(config.faults)}", flush=True)
  run.workdir = workdir
  run.metrics = MetricsWriter(
    workdir,
    tensorboard=config.tensorboard,
    wandb=config.logging,
    config=config.to_dict() if config.logging.wandb else None,
  )
  distributed.sync("setup")  # the hosts' set-up times differ; collectives follow
  run.ckpt = Checkpointer(files.join(workdir, "checkpoints"), config.checkpoint.keep, name="run")
  if run.ckpt.latest_step() is not None:
    if restore_step:
      _check_vocab_ids(run, restore_step)
      run.state, run.meta = run.ckpt.restore(abstract_like(run.state), restore_step)
    else:
      restore_step = _restore_intact(run, training)
    _upgrade_meta(run.meta, config.rl.mode, config.rl.advantage)
    print(
      f"Resumed from checkpoint {restore_step} at stage "
      f"{run.meta['stage']} step {run.meta['stage_step']}",
      flush=True,
    )
  return run


def _restore_intact(run: Run, training: bool) -> int:
  """Restores the newest checkpoint that restores; its step.

  Each newer one (damaged: truncated, files missing, unreadable) is logged
  with its step and error. A training run also sets it aside as
  `damaged-<step>` (process 0; orbax would otherwise count it as the
  latest step and skip saving that step anew) and counts it in
  meta["checkpoints_skipped"] (over the run's launches), written to the
  metrics as "checkpoint/damaged_skipped" (stage "resume"). A tool reading
  the workdir moves nothing under the trainer that writes it.
  """
  readable = committed_checkpoints(files.join(run.workdir, "checkpoints"))
  if readable:  # the vocabulary's one line, before orbax's shape error
    _check_vocab_ids(run, max(readable))
  step, run.state, run.meta, skipped = run.ckpt.restore_intact(
    abstract_like(run.state), set_aside=training and distributed.is_primary()
  )
  for bad, why, where in skipped:
    print(
      f"[checkpoint] skipped damaged checkpoint {bad} ({why}), resuming from {step}"
      + (f"; set aside as {where}" if where else ""),
      flush=True,
    )
  if skipped and training:
    distributed.sync("checkpoint_set_aside")
    run.ckpt.reload()
    run.meta["checkpoints_skipped"] = run.meta.get("checkpoints_skipped", 0) + len(skipped)
    run.metrics.write(
      run.meta["stage_step"],
      {
        "checkpoint/damaged_skipped": run.meta["checkpoints_skipped"],
        "checkpoint/resumed_from": step,
      },
      "resume",
    )
  return step


def _check_vocab_ids(run: Run, step: int) -> None:
  """The checkpoint's head was trained over the ids this run's head has
  (model.vocab_subset: computed from the environment's rows, so another
  dataset gives another head); else one line, before orbax's shape error."""
  saved = committed_checkpoints(files.join(run.workdir, "checkpoints")).get(step, {})
  check_lora_base(saved, step, run.meta.get("lora_base"), run.workdir)
  theirs, ours = saved.get("vocab_ids"), list(run.model_cfg.vocab_ids) or None
  if "vocab_ids" in saved and theirs != ours:
    describe = lambda ids: f"a head over {len(ids)} token ids" if ids else "the full head"
    raise configuration.ConfigError(
      f"model.vocab_subset: checkpoint {step} in {run.workdir} has {describe(theirs)}, this "
      f"run's config gives {describe(ours)} (another dataset or vocab_subset setting); "
      "resume with the config the run was started with, or use a new workdir"
    )


def _upgrade_meta(meta: dict, mode: str, advantage: str) -> None:
  """Moves the keys of checkpoints written by earlier versions to today's.

  Before trajectory sources (sao_jax/train/sources.py) a source's state had
  keys of its own: the fleet's cursor under "fleet", the in-process prompt
  order under "prompt_state"; now both are "source". A critic-free
  estimator's host state was kept under "running_mean" whatever the
  estimator; now "estimator_state" maps the estimator's name (the run's
  `rl.advantage`, whose state it was) to it. Idempotent."""
  if "source" not in meta:
    fleet_cursor, prompt_state = meta.pop("fleet", None), meta.pop("prompt_state", None)
    if mode == "fleet":
      meta["source"] = fleet_cursor
    else:
      meta["source"] = None if prompt_state is None else {"prompt_state": prompt_state}
  if "estimator_state" not in meta:
    old = meta.pop("running_mean", None)
    meta["estimator_state"] = {} if old is None else {advantage: old}


def load(
  config: ml_collections.ConfigDict | sections.Sections,
  workdir: str,
  step: int | None = None,
  training: bool = False,
) -> Run:
  """A run restored from `workdir` (fresh if it has no checkpoint); `training`:
  see `open_workdir`."""
  return open_workdir(build(config), workdir, step, training)
