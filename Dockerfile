# GPU worker image: CUDA runtime, the project installed with the CUDA build of torch, `enclave worker` as
# entrypoint. Settings come from the environment (ENCLAVE_DATABASE_URL, ENCLAVE_BROKER_URL, ENCLAVE_MODEL).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
    && useradd --create-home --uid 1000 enclave
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 ENCLAVE_HOME=/var/lib/enclave \
    ENCLAVE_MIGRATIONS=/opt/enclave/migrations

WORKDIR /opt/enclave
COPY pyproject.toml README.md ./
COPY engine engine
COPY pipeline pipeline
COPY jobs jobs
COPY migrations migrations
# PyPI's default torch wheel is the CUDA build, which is what this image wants.
RUN pip install --no-cache-dir "torch>=2.11" ".[worker]"

RUN mkdir -p /var/lib/enclave && chown enclave /var/lib/enclave
USER enclave
VOLUME ["/var/lib/enclave", "/models"]
ENTRYPOINT ["enclave", "worker"]
CMD ["--concurrency", "8"]
