"""A run's checkpoint as Hugging Face directories that serving engines load alone.

    export(config, workdir, "hf/", step="rl:50")       # or checkpoint=7, or the latest

writes the policy (`hf_export.export_params`) with everything `vllm serve
hf/`, SGLang, lm-eval and `transformers` need besides the weights: the
run's tokenizer and chat template (sao_jax/envs/hf_tokenizer_export.py),
generation_config.json, and the bos / eos / pad ids in config.json. A head
over a vocabulary subset (`model.vocab_subset`) is written over the whole
vocabulary (`hf_export.full_vocabulary`). The critic goes to `<out>-value`
where its family has a token-classification class.

Which checkpoint. A checkpoint is numbered in the order it was saved
(`checkpoints/<N>`, `checkpoint=N`); a training step names where the policy
was (`step="rl:50"`: after 50 RL steps; `"sft:200"`; a bare number is an RL
step). Nothing is created when the step, the checkpoint or the workdir is
missing, and the error lists the checkpoints there are.
"""

from __future__ import annotations

import os

from sao_jax.data import files
from sao_jax.data.checkpoint import committed_checkpoints
from sao_jax.envs import hf_tokenizer_export
from sao_jax.models import families, hf_export
from sao_jax.train import distributed
from sao_jax.train import run as run_lib


def training_step(meta: dict, config) -> tuple[str, int]:
  """(stage, step) of the policy a checkpoint holds: ("sft", n) after n SFT steps,
  ("rl", n) after n RL steps. Value pretraining leaves the policy at SFT's end; the
  run's last checkpoint ("done") holds RL's end, counted as `rl.steps` (a run that a
  generated-token budget stopped earlier records no other count)."""
  stage, step = meta.get("stage"), int(meta.get("stage_step", 0))
  if stage == "value_pretrain":
    return "sft", int(meta.get("sft_stopped_at") or config.sft.steps)
  if stage == "done":
    return "rl", int(config.rl.steps)
  return str(stage), step


def parse_step(step: str | int) -> tuple[str, int]:
  """ "rl:50" / "sft:200" / "50" (an RL step) -> (stage, step)."""
  text = str(step).strip()
  stage, _, number = text.rpartition(":")
  stage = stage or "rl"
  if stage not in ("sft", "rl") or not number.isdigit():
    raise hf_export.ExportError(f"step = {text!r}: an RL step (50, rl:50) or an SFT step (sft:200)")
  return stage, int(number)


def _listing(found: dict, config) -> str:
  return (
    ", ".join(
      f"checkpoint {n} ({'%s step %d' % training_step(found[n], config)})" for n in sorted(found)
    )
    or "none"
  )


def find_checkpoint(config, workdir: str, step=None, checkpoint: int | None = None) -> int:
  """The checkpoint number to export: `checkpoint`, the newest holding training
  `step`, or the newest. Raises FileNotFoundError (listing what there is) and
  creates nothing."""
  if step is not None and checkpoint is not None:
    raise hf_export.ExportError(
      "give step (a training step) or checkpoint (a checkpoint's number), not both"
    )
  if not files.exists(workdir):
    raise FileNotFoundError(f"no run at {workdir}: the directory does not exist")
  where = files.join(workdir, "checkpoints")
  found = committed_checkpoints(where)
  if not found:
    raise FileNotFoundError(f"no checkpoint under {where}")
  if checkpoint is not None:
    if checkpoint not in found:
      raise FileNotFoundError(
        f"checkpoint {checkpoint} is not under {where}; there are: {_listing(found, config)}"
      )
    return checkpoint
  if step is None:
    return max(found)
  wanted = parse_step(step)
  holding = [n for n in found if training_step(found[n], config) == wanted]
  if not holding:
    raise FileNotFoundError(
      f"no checkpoint of {wanted[0]} step {wanted[1]} under {where}; "
      f"there are: {_listing(found, config)}"
    )
  return max(holding)  # the newest: the same policy, the most trained critic


def _sampling(config) -> dict:
  """The rollout's sampling, generation_config.json's defaults (what the policy learnt at)."""
  r = config.rollout
  out = {"temperature": float(r.temperature)}
  if r.top_p < 1.0:
    out["top_p"] = float(r.top_p)
  if r.top_k:
    out["top_k"] = int(r.top_k)
  return out


def _tokenizer(run, model_cfg, record: dict | None) -> tuple[dict, dict]:
  """(extra files, config.json entries) of the run's tokenizer; `record`: a subset
  head's, whose uncovered ids generation_config.json suppresses."""
  env = run.config.env
  files_out = hf_tokenizer_export.tokenizer_files(
    env,
    run.tok,
    run.format.turn_end_id,
    max_len=int(model_cfg.max_seq_len),
    sampling=_sampling(run.config),
  )
  ids = hf_tokenizer_export.special_ids(run.tok, run.format.turn_end_id) if files_out else {}
  if record is not None and "generation_config.json" in files_out:
    files_out["generation_config.json"] = hf_tokenizer_export.suppressing(
      files_out["generation_config.json"], record["outside_ids"]
    )
  return files_out, ids


def export(
  config,
  workdir: str,
  out: str,
  step=None,
  *,
  checkpoint: int | None = None,
  dtype: str = "bfloat16",
  shard_bytes: int = 5 * 2**30,
  value_out: str | None = "",
) -> dict:
  """The policy of a checkpoint (module docstring) as an HF directory `out`.

  `config`: the flags' config (`run.build` loads it) or its typed sections.

  `value_out`: the critic too, as its own directory ("": `<out>-value`;
  None: not exported). Every process calls this (the gathers are
  collective); process 0 writes. Returns `hf_export.export_params`' stats
  per directory ("policy", "value").
  """
  number = find_checkpoint(config, workdir, step, checkpoint)
  run = run_lib.load(config, workdir, number)
  try:
    policy, model_cfg, subset = _params(run, "policy"), run.model_cfg, None
    if model_cfg.vocab_ids:
      policy, model_cfg, subset = hf_export.full_vocabulary(policy, run.model_cfg)
    # Only process 0 writes: the others skip building the tokenizer files.
    extra, ids = _tokenizer(run, model_cfg, subset) if distributed.is_primary() else ({}, {})
    notes = {
      "workdir": files.absolute(workdir),
      "checkpoint": number,
      "training_step": "%s:%d" % training_step(run.meta, run.config),
      "policy_version": int(run.state.step),
      "stage": run.meta["stage"],
      "model_preset": run.config.model.preset,
      "tokenizer": run.config.env.tokenizer_path or run.config.env.tokenizer,
      "chat_format": run.config.env.chat_format,
      "tokenizer_files": sorted(extra),
    }
    if subset is not None:
      notes["vocab_subset"] = {k: v for k, v in subset.items() if k != "outside_ids"}
    if not extra:
      notes["tokenizer_note"] = (
        "sao-jax's character tokenizer (sao_jax/envs/tokenizer.py): "
        "no Hugging Face tokenizer files exist for it"
      )
    result = {
      "policy": hf_export.export_params(
        policy,
        model_cfg,
        out,
        dtype=dtype,
        shard_bytes=shard_bytes,
        extra_files=extra,
        notes=notes,
        carry=_carry(run.meta),
        config_extra=ids,
      )
    }
    if value_out is not None:
      result["value"] = _export_value(
        run, out, value_out, notes, extra, ids, dtype=dtype, shard_bytes=shard_bytes
      )
    return result
  finally:
    run.close()


def _export_value(run, out: str, value_out: str, notes: dict, extra: dict, ids: dict, **kw) -> dict:
  """The critic as `value_out` ("": `<out>-value`), or why it is not exported."""
  fam = families.get(run.model_cfg.family)
  if fam.token_classification is None:
    # transformers has no class to load such a critic: the policy is exported alone.
    return {
      "skipped": f"transformers has no token-classification class for {fam.name}: "
      "the critic is not exported"
    }
  critic, model_cfg = _params(run, "critic"), run.model_cfg
  if model_cfg.vocab_ids:
    critic, model_cfg, _ = hf_export.full_vocabulary(critic, run.model_cfg, head="value")
  extra = {k: v for k, v in extra.items() if k != "generation_config.json"}
  return hf_export.export_params(
    critic,
    model_cfg,
    value_out or f"{out.rstrip('/')}-value",
    head="value",
    extra_files=extra,
    notes=dict(notes, value_head=hf_export.VALUE_HEAD_NOTE),
    config_extra=ids,
    **kw,
  )


def _params(run, which: str):
  """The policy's or critic's full params: a LoRA run's base merged with its adapters
  (`Run.policy_params`, `Run.critic_params`), else the state's."""
  full = getattr(run, f"{which}_params", None)
  return full() if full is not None else getattr(run.state, which)


def _carry(meta: dict) -> tuple[str, list] | None:
  """The source tensors a policy export carries over (run.py's
  "carried_tensors": model.hf_dir's MTP head), checked to still be there."""
  carried = meta.get("carried_tensors")
  if not carried:
    return None
  if not os.path.isdir(carried["dir"]):
    raise FileNotFoundError(
      f"the run started from {carried['dir']}, whose {len(carried['names'])} MTP-head "
      "tensors an export carries over unchanged; it is gone: restore it, or the export "
      "would drop them"
    )
  return carried["dir"], carried["names"]
