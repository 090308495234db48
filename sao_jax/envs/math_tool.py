"""math_tool: the paper's agentic-reasoning environment, math with a Python tool.

    env.name = "math_tool"
    env.kwargs = {"path": "my_train.jsonl", "heldout_path": "my_test.jsonl"}  # optional
    env.tokenizer = "qwen3"; env.chat_format = "qwen3"

The dataset environment (`sao_jax.envs.dataset`) with the paper's setting
as its defaults: a system prompt that asks for reasoning, tool use and a
final answer in `\\boxed{}`; one `python` tool (a code string) run in the
sandbox, its stdout and error returned as the tool response; up to 50
turns; the answer checked by the math verifier in the trainer-side process
(integers exactly, the rest with math-verify under a wall clock). Any
verl-style dataset works; without a `path` it trains on the shipped
generated set (`sao_jax.envs.math_problems`: 4,000 training and 400
held-out rows, every one with a tool-using demonstration for SFT).

Every option of the dataset environment is an `env.kwargs` key here too
(`DatasetConfig`'s fields); only the defaults differ.
"""

from __future__ import annotations

import dataclasses

from sao_jax.envs import math_problems
from sao_jax.envs.dataset import DatasetConfig, DatasetEnv

SYSTEM_PROMPT = (
  "Solve the problem. You can run Python with the python tool; use print() to "
  "see a result. Put the final answer in \\boxed{}."
)


@dataclasses.dataclass(frozen=True)
class MathToolConfig(DatasetConfig):
  path: str = math_problems.SHIPPED_TRAIN
  heldout_path: str = math_problems.SHIPPED_HELDOUT
  system_prompt: str = SYSTEM_PROMPT
  verifier: str = "math"
  tools: tuple = ("python",)
  # The paper's reasoning runs take up to 50 turns of reasoning and tool calls.
  max_turns: int = 50
  # A curriculum from the shipped set: only rows whose extra_info.family is
  # one of these (math_problems.FAMILIES: "remainder", "expression", ...),
  # in training and held out alike. (): every row.
  families: tuple = ()

  def __post_init__(self):
    unknown = sorted(set(self.families) - set(math_problems.FAMILIES))
    if unknown:
      raise ValueError(
        f"families {unknown}: the shipped set's are {sorted(math_problems.FAMILIES)}"
      )


class MathTool(DatasetEnv):
  """The dataset environment under math_tool's defaults (module docstring)."""

  name = "math_tool"

  def keeps(self, row) -> bool:
    families = self.config.families
    return not families or (row.extra_info or {}).get("family") in families
