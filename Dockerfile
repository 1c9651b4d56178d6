# The vLLM OpenAI server with kvtier: the image the Helm chart (deploy/helm/kvtier)
# runs by default. Build it from a checkout of this repository:
#
#   docker build -t kvtier:0.1.0 .
#
# The tag is kvtier's version (pyproject.toml), which is the chart's appVersion.
# VLLM_IMAGE picks the vLLM release (one kvtier supports: the `gpu` extra's range).

ARG VLLM_IMAGE=vllm/vllm-openai:v0.34.0

# -- kvtier's wheel, built from the checkout (pure Python: any Python 3.11+ builds it),
# and a requirements line that installs it with its s3 and redis extras
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvtier ./kvtier
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels . \
    && for whl in /tmp/wheels/kvtier-*.whl; do \
         echo "kvtier[s3,redis] @ file://$whl" > /tmp/wheels/requirements.txt; \
       done

# -- vLLM with kvtier installed into the same Python environment
FROM ${VLLM_IMAGE}
COPY --from=wheel /tmp/wheels /tmp/wheels
# s3 and redis: the object tiers the chart configures (kvtier.remoteUrl)
RUN python3 -m pip install --no-cache-dir -r /tmp/wheels/requirements.txt \
    && rm -rf /tmp/wheels \
    && python3 -c "import vllm, kvtier.connectors.vllm, boto3, redis"
# not root: the chart's pod runs as UID/GID 10001 (podSecurityContext) with a
# read-only root filesystem; vLLM writes only to /tmp, /dev/shm and its caches there
USER 10001:10001
ENV HOME=/tmp
