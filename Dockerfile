# GPU worker image: CUDA runtime, the project installed with the CUDA build of torch.
# Until the pipeline lands (issue 3, `enclave worker`), the entrypoint runs the engine demo.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1

WORKDIR /opt/enclave
COPY pyproject.toml README.md ./
COPY engine engine
COPY pipeline pipeline
COPY jobs jobs
# PyPI's default torch wheel is the CUDA build, which is what this image wants.
RUN pip install --no-cache-dir "torch>=2.11" .

ENTRYPOINT ["python", "-m", "engine.demo"]
