# A runnable image of the server with the bundled default model.
#   docker build -t gptserve .
#   docker run -p 8000:8000 -e GPTSERVE_API_KEYS=choose-a-key gptserve
#   docker run -p 8000:8000 -e GPTSERVE_API_KEYS=choose-a-key -v /path/to/ckpt:/model -e GPTSERVE_MODEL=/model gptserve
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

ARG TORCH_VERSION=2.13.0
RUN useradd --create-home --uid 10001 gptserve
WORKDIR /app

# a C++ compiler: the CPU kernels (kernels/cpu/*.cpp) are built for the host on first start
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# torch first and on its own layer: it is the big one and changes least often
RUN pip install "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md train.py ./
COPY model ./model
COPY kernels ./kernels
COPY engine ./engine
COPY server ./server
COPY training ./training
RUN pip install . && rm -rf /app/build

USER gptserve
# the checkpoint to serve: the bundled default model unless overridden
ENV GPTSERVE_MODEL=""
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
CMD ["sh", "-c", "exec gptserve serve --host 0.0.0.0 --port 8000 ${GPTSERVE_MODEL:+--model \"$GPTSERVE_MODEL\"}"]
