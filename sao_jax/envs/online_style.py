"""online_style: a non-stationary writing task whose preferred style shifts.

The prompt asks for one line about a topic ("write about rain\n"); the agent
answers in one turn. A deterministic judge scores it:

  * quality: the topic word appears, 3-12 words, no word used more than
    twice, only letters and spaces;
  * style: the style whose marker words the line uses most (ties: none).

"Letters" are ASCII letters and "spaces" the ASCII space, and words compare
case-insensitively (lower-cased), each at most 20 letters long. Without
that, the repetition rule is evaded by spelling a word differently
("rain Rain RAIN", a Cyrillic "а" for "a", full-width letters), Unicode
letters and spaces (tabs, newlines, U+3000) pass `str.isalpha`/`str.split`,
and a "word" could be a million letters long. A capitalised first word is a
normal sentence and is fine.

The reward is 1 when quality holds and the style is the one currently
preferred; `quality_credit` (default 0) when quality holds in another style
or none, 0 otherwise. With credit, after a shift a policy that settled on
the old style still sees rewards that keep the form of a line, rather than
zero on every sample. The preference cycles through four styles (academic,
cute, chuunibyou, classical, like the paper's simulation) every `switch_every`
training episodes started (evaluation uses `frozen()`, which reads the
schedule without advancing it), so a policy that settled on one style must re-adapt after
each switch: the online-learning setting where SAO's critic recovers faster
than a running-mean baseline.
"""

from __future__ import annotations

import dataclasses
import re
import threading

import numpy as np

from sao_jax.envs.base import StepResult, Task

STYLES = {
  "academic": ("thus", "hence", "indeed"),
  "cute": ("uwu", "nya", "hehe"),
  "chuuni": ("dark", "flame", "fate"),
  "classical": ("thou", "doth", "hath"),
}
TOPICS = ("cat", "rain", "moon", "tea", "road", "sea", "tree", "bell")
_FILLER = ("the", "a", "is", "so", "my", "and", "soft", "old", "bright", "still")


@dataclasses.dataclass(frozen=True)
class OnlineStyleConfig:
  seed: int = 0
  switch_every: int = 2000
  # The style preferred first; then the next in STYLES' order, cyclically.
  first_style: int = 0
  # Reward of a well-formed line not in the preferred style, in [0, 1).
  quality_credit: float = 0.0

  def __post_init__(self):
    if self.switch_every < 1:
      raise ValueError(f"switch_every must be >= 1, got {self.switch_every}")
    if not 0.0 <= self.quality_credit < 1.0:
      raise ValueError(f"quality_credit must be in [0, 1), got {self.quality_credit}")


_MAX_WORD_LETTERS = 20
# Longer than any line of at most 12 words (with a few extra spaces): not
# a line, and not worth splitting.
_MAX_CHARS = 400
_LETTERS_AND_SPACES = re.compile(r"[A-Za-z ]*")


def judge(text: str, topic: str) -> tuple[bool, str | None]:
  """(quality ok, detected style or None); see the module docstring."""
  if len(text) > _MAX_CHARS:
    return False, None
  # `isascii` before `lower`: some non-ASCII letters lower-case to ASCII
  # (the Kelvin sign to "k").
  plain = text.isascii() and _LETTERS_AND_SPACES.fullmatch(text) is not None
  words = text.lower().split()
  quality = (
    plain
    and topic in words
    and 3 <= len(words) <= 12
    and all(len(w) <= _MAX_WORD_LETTERS for w in words)
    and max((words.count(w) for w in words), default=0) <= 2
  )
  counts = {s: sum(w in markers for w in words) for s, markers in STYLES.items()}
  best = max(counts.values())
  winners = [s for s, c in counts.items() if c == best]
  style = winners[0] if best > 0 and len(winners) == 1 else None
  return quality, style


class _Episode:
  def __init__(self, env: "OnlineStyle", task: Task, preferred: str):
    self._env, self._task, self.preferred = env, task, preferred

  def step(self, action: str) -> StepResult:
    quality, style = judge(action.strip(), self._task.meta["topic"])
    ok = quality and style == self.preferred
    reward = 1.0 if ok else (self._env.config.quality_credit if quality else 0.0)
    return StepResult(
      "", float(reward), True, {"correct": ok, "style": style, "preferred": self.preferred}
    )


class OnlineStyle:
  name = "online_style"
  max_turns = 1

  def __init__(self, config: OnlineStyleConfig = OnlineStyleConfig()):
    self.config = config
    self._episodes = 0  # training episodes started: the schedule's clock
    self._lock = threading.Lock()

  def preferred_style(self, episode_number: int) -> str:
    names = list(STYLES)
    k = episode_number // self.config.switch_every + self.config.first_style
    return names[k % len(names)]

  def task(self, index: int) -> Task:
    rng = np.random.default_rng([self.config.seed, index])
    topic = TOPICS[int(rng.integers(len(TOPICS)))]
    return Task(index, f"write about {topic}\n", None, {"topic": topic})

  def episode(self, task: Task) -> _Episode:
    with self._lock:
      n = self._episodes
      self._episodes += 1
    return _Episode(self, task, self.preferred_style(n))

  def frozen(self) -> "_FrozenView":
    """This environment for evaluation and value pretraining.

    Its episodes are judged by the preference of the moment but do not
    advance the schedule, so only training episodes move the preference
    (held-out evaluations of 400 tasks would otherwise shift it mid-run).
    """
    return _FrozenView(self)

  def demonstration(self, task: Task, style: str | None = None) -> list[tuple[str, str]]:
    """A good line in `style` (default: one drawn per task, all styles alike)."""
    rng = np.random.default_rng([self.config.seed, task.index, 1])
    style = style or list(STYLES)[int(rng.integers(len(STYLES)))]
    markers = list(STYLES[style])
    rng.shuffle(markers)
    filler = list(rng.choice(_FILLER, size=3, replace=False))
    words = [filler[0], task.meta["topic"], markers[0], filler[1], filler[2], markers[1]]
    return [(" ".join(words), "")]


class _FrozenView:
  """OnlineStyle whose episodes read the schedule without advancing it."""

  def __init__(self, env: OnlineStyle):
    self._env = env
    self.name, self.max_turns, self.config = env.name, env.max_turns, env.config

  def task(self, index: int) -> Task:
    return self._env.task(index)

  def demonstration(self, task: Task, style: str | None = None):
    return self._env.demonstration(task, style)

  def episode(self, task: Task) -> _Episode:
    with self._env._lock:
      n = self._env._episodes
    return _Episode(self._env, task, self._env.preferred_style(n))
