"""SIGKILL during a checkpoint save: the last complete checkpoint restores bit-exact."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

from sao_jax.data.checkpoint import Checkpointer, committed_checkpoints

# Step 1 is saved and waited for; step 2 (64 MiB, so the async save is
# still writing) is started, and the process kills itself without waiting.
_WRITER = textwrap.dedent("""
    import os, signal, sys
    import jax.numpy as jnp, numpy as np
    from sao_jax.data.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], max_to_keep=3)
    def state(seed, n):
      r = np.random.default_rng(seed)
      return {"w": jnp.asarray(r.standard_normal(n, np.float32)),
              "b": jnp.asarray(r.integers(0, 100, 7, np.int32))}
    ckpt.save(1, state(1, 1000), {"stage": "rl", "stage_step": 2})
    ckpt.wait()
    ckpt.save(2, state(2, 16 * 2**20), {"stage": "rl", "stage_step": 4})
    print("saving", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _state(seed, n):
  r = np.random.default_rng(seed)
  return {"w": r.standard_normal(n, np.float32), "b": r.integers(0, 100, 7, np.int32)}


def test_kill_during_save_restores_last_complete_bit_exact(tmp_path):
  directory = str(tmp_path / "ckpt")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run([sys.executable, "-c", _WRITER, directory], capture_output=True,
                        text=True, timeout=300, cwd=root,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == -9 and "saving" in proc.stdout, proc.stderr[-2000:]
  committed = committed_checkpoints(directory)
  assert 1 in committed and committed[1]["stage_step"] == 2
  ckpt = Checkpointer(directory, max_to_keep=3)
  latest = ckpt.latest_step()
  assert latest in committed  # never a half-written step
  n = 1000 if latest == 1 else 16 * 2**20
  expect = _state(latest, n)
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in expect.items()}
  state, meta = ckpt.restore(abstract)
  assert meta == committed[latest]
  for k in expect:
    np.testing.assert_array_equal(np.asarray(state[k]), expect[k])
  # The run goes on: the next save over the killed one's leftovers completes.
  ckpt.save(3, {k: jax.numpy.asarray(v) for k, v in _state(3, 10).items()},
            {"stage": "rl", "stage_step": 6})
  ckpt.close()
  assert 3 in committed_checkpoints(directory)
