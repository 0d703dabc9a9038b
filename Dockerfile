# A runnable image of the server with the default model and the CPU kernels built in: a container
# neither downloads nor compiles when it starts (deploy/docker/install.sh, docs/DEPLOY.md).
#   docker build -t gptserve .
#   docker build -t gptserve:cpu --build-arg TORCH_INDEX_URL=<PyTorch's CPU-only wheel index> .
#   docker run -p 8000:8000 -e GPTSERVE_API_KEYS=choose-a-key gptserve
#   docker run -p 8000:8000 -e GPTSERVE_API_KEYS=choose-a-key -v /path/to/ckpt:/model -e GPTSERVE_MODEL=/model gptserve
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GPTSERVE_CACHE=/opt/gptserve/cache \
    TORCH_EXTENSIONS_DIR=/opt/gptserve/kernels

ARG TORCH_VERSION=2.13.0
# empty: torch from the default index (its CUDA build); PyTorch's CPU-only index: a CPU image
ARG TORCH_INDEX_URL=
# the -march targets the CPU kernels are prebuilt for; a host runs the best one it can
ARG KERNEL_TARGETS=x86-64-v3,x86-64-v4
RUN useradd --create-home --uid 10001 gptserve
WORKDIR /app

# a C++ compiler: the CPU kernels are built at image build time (and by a host that asks for its
# own build with GPTSERVE_NATIVE_ARCH=native)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/docker/install.sh ./deploy/docker/install.sh
# torch first and on its own layer: it is the big one and changes least often
RUN TORCH_VERSION="${TORCH_VERSION}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" deploy/docker/install.sh torch
COPY pyproject.toml README.md ./
COPY gptserve ./gptserve
COPY model ./model
COPY kernels ./kernels
COPY engine ./engine
COPY server ./server
COPY training ./training
RUN deploy/docker/install.sh project && rm -rf /app/build \
    && KERNEL_TARGETS="${KERNEL_TARGETS}" deploy/docker/install.sh prepare \
    && chown -R gptserve /opt/gptserve

USER gptserve
# the checkpoint to serve: the bundled default model unless overridden
ENV GPTSERVE_MODEL=""
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
CMD ["sh", "-c", "exec gptserve serve --host 0.0.0.0 --port 8000 ${GPTSERVE_MODEL:+--model \"$GPTSERVE_MODEL\"}"]
