# sao-jax on Cloud TPU hosts: the image launch/pod.py's JobSet (--emit=jobset)
# and a Ray cluster's TPU workers run. Not built or run on the project's
# machines (no container runtime, no TPU there); README "Running on a TPU pod".
#
#   docker build -t REGION-docker.pkg.dev/PROJECT/REPO/sao-jax:TAG .
#   python launch/pod.py --config=configs/sao_moe.py --workdir=/mnt/shared/run \
#       --emit=jobset --out=job.json --config.pod.image=REGION-docker.pkg.dev/PROJECT/REPO/sao-jax:TAG
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends git && \
    rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Dependencies first (a cached layer while the code changes).
COPY setup.py README.md ./
RUN mkdir -p sao_jax && touch sao_jax/__init__.py && \
    pip install --no-cache-dir -e '.[aot,math,parquet,humaneval,pod,gcs]' && \
    rm -rf sao_jax
COPY . .
RUN pip install --no-cache-dir --no-deps -e . && \
    python -c "import sao_jax, jax, ray; print('sao_jax', jax.__version__, ray.__version__)"

ENV PYTHONUNBUFFERED=1
# The JobSet and the Ray actors give the command (launch/train.py or launch/rollout.py).
CMD ["python", "launch/pod.py", "--help"]
