"""A Qwen3.5 checkpoint as a user brings it, through the whole chain on CPU.

A tiny random `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM.save_pretrained`
directory (the hybrid: Gated DeltaNet and gated full attention, routed plus
shared experts or dense MLPs; tests/hf_fixtures.py) with an MTP head added beside it, given to
configs/qwen3_colab.py as `model.hf_dir`: SFT -> value pretraining -> async
SAO -> eval run from its weights, and launch/export.py writes a directory
transformers loads, the MTP head carried over unchanged.
"""

import json
import os

import hf_fixtures
import numpy as np
import pytest
import runs

torch = pytest.importorskip("torch", reason="the 'parity' extra (make test installs it)")
transformers = pytest.importorskip("transformers")

FLAGS = (
  "--config.sharding.mesh={'data': 1}",
  "--config.sft.steps=2",
  "--config.sft.batch_size=4",
  "--config.value_pretrain.steps=2",
  "--config.value_pretrain.num_trajectories=4",
  "--config.rl.steps=2",
  "--config.rl.batch_size=4",
  "--config.rollout.slots=4",
  "--config.eval.num_tasks=4",
  "--config.eval.slots=4",
  "--config.log_every=1",
  "--config.tensorboard=False",
)


def _add_mtp_head(hf_dir: str) -> np.ndarray:
  """An `mtp.*` tensor beside the weights, as the releases ship one."""
  from safetensors.torch import load_file, save_file

  path = os.path.join(hf_dir, "model.safetensors")
  tensors = load_file(path)
  mtp = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
  save_file({**tensors, "mtp.fc.weight": mtp}, path, metadata={"format": "pt"})
  return mtp.float().numpy()


@pytest.mark.slow  # ~2-5 min on 2 cores; the hybrid's pieces are tests/models/test_qwen3_5.py
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_a_qwen3_5_checkpoint_trains_through_every_stage_and_exports(tmp_path, moe):
  hf_dir = hf_fixtures.write_tiny_qwen3_5(str(tmp_path / "tiny_qwen3_5"), moe=moe)
  mtp = _add_mtp_head(hf_dir)
  workdir, out = str(tmp_path / "wd"), str(tmp_path / "export")
  log = runs.launch(workdir, config=f"qwen3_colab.py:{hf_dir}", run_flags=FLAGS, devices=1)
  family = "qwen3_5_moe" if moe else "qwen3_5"
  assert f"[model] {family} from" in log and "MTP-head tensors" in log
  for stage in ("[sft] 2/2", "[value_pretrain] 2/2", "[rl] 2/2", "[done]"):
    assert stage in log, log[-3000:]
  exported = runs.launch(
    workdir,
    f"--out={out}",
    script="export.py",
    config=f"qwen3_colab.py:{hf_dir}",
    run_flags=FLAGS[:1],
    devices=1,
  )
  # transformers has no token classifier that loads a Qwen3.5 text model:
  # the critic is not exported, and the export says so.
  assert "transformers has no token-classification class" in exported
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  assert type(model).__name__ == ("Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM")
  index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
  assert index["weight_map"]["mtp.fc.weight"] == "model-carried.safetensors"
  from safetensors.torch import load_file

  carried = load_file(os.path.join(out, "model-carried.safetensors"))["mtp.fc.weight"]
  assert carried.dtype == torch.bfloat16
  np.testing.assert_array_equal(carried.float().numpy(), mtp)
