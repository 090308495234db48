"""The repository's run configs: one `get_config()` file per arm, the CPU default to the pod.

Each file is an ml_collections config that an entry point loads by path
(`python launch/train.py --config=configs/sao_tiny.py`). `common.py` holds
the defaults every config starts from; the others change what their arm
changes and import their base as a module of this package
(`from configs import common`, `from configs import sao_moe`), so an arm
that derives from another stays one edit away from it.

`configs` is a package of the repository, not of the installed library:
setup.py packages `sao_jax` alone, and a config is a file a user copies and
edits next to the code rather than an API. Whatever loads a config therefore
puts the repository root on `sys.path`: each `launch/*.py` does it for its
own checkout (so an absolute `--config` path works from any working
directory), tests/conftest.py for the tests, and `python -m` or `python -c`
from the root gets it from the working directory.
"""
