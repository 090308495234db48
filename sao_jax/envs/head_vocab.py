"""The token ids a run's head covers with `model.vocab_subset = "env"`.

A model trained from scratch on one environment needs a head column only
for the ids it may have to write, and an embedding row only for the ids it
reads; sao_jax/models/head_vocab.py maps the rest to one shared row. The
subset is computed once per process from the environment, in a fixed order,
so every process of a run (trainer, rollout workers, evaluation) gets the
same ids:

  * every id of every row's prompt as the chat format renders it (system
    message and tools block included), training and held-out rows;
  * every id of every demonstration (its actions, and the tool outputs it
    shows);
  * the tokenizer's added tokens (chat-template and tool-call markers);
  * every printable ASCII character and newline alone, so the policy can
    still spell any ASCII text.

For the shipped math set under Qwen3's tokenizer and chat template this is
1,386 of 151,669 ids (`ids_for(config.env)`; tests/models/test_head_vocab.py).
"""

from __future__ import annotations

import dataclasses
import json
import string

from sao_jax.config import sections
from sao_jax.config.sections import ConfigError
from sao_jax.data.prompts import EVAL_OFFSET
from sao_jax.envs import base, registry
from sao_jax.envs.demonstrations import demonstration_trajectory


def env_ids(env, tok, fmt) -> tuple[int, ...]:
  """The sorted ids `env`'s rows, demonstrations and `tok`'s controls use (module docstring).

  `env` must list its rows (`train_rows`, `heldout_rows`: the dataset
  family, math_tool); a generator of unbounded tasks has no such list.
  """
  if not (hasattr(env, "train_rows") and hasattr(env, "heldout_rows")):
    raise ConfigError(
      f"model.vocab_subset = 'env' needs an environment with a finite row "
      f"list (dataset, math_tool); {type(env).__name__} has none"
    )
  ids: set[int] = set()
  for index in [
    *range(len(env.train_rows)),
    *(EVAL_OFFSET + j for j in range(len(env.heldout_rows))),
  ]:
    task = env.task(index)
    ids.update(fmt.prompt_ids(task.prompt, base.task_tools(task)))
    if index < EVAL_OFFSET and base.task_meta(task).get("completion"):
      ids.update(int(t) for t in demonstration_trajectory(env, task, tok, fmt).tokens)
  ids.update(tok.special_id(t) for t in tok.added_tokens)
  for c in string.printable:
    ids.update(tok.encode_lossy(c))
  return tuple(sorted(ids))


_CACHE: dict[str, tuple[int, ...]] = {}


def ids_for(env_config, env=None, tok=None) -> tuple[int, ...]:
  """`env_ids` of the environment an env section builds, once per process.

  `env_config`: the env section (sections.Env, or a ConfigDict / dict of its
  fields); `env` / `tok`: that section's environment and tokenizer when the
  caller has built them already (else they are built here).
  """
  e = sections.Env.of(env_config)
  key = json.dumps(dataclasses.asdict(e), sort_keys=True, default=str)
  if key not in _CACHE:
    tok = tok or registry.make_tokenizer(e)
    env = env or registry.make_env(e)
    _CACHE[key] = env_ids(env, tok, registry.make_format(e, tok))
  return _CACHE[key]
