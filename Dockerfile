# One image for the quantizer, the worker and the gateway; docker-compose.yml picks the command.
# TORCH_SPEC: the default takes the CUDA build of torch from PyPI (it bundles the CUDA runtime, so
# the host needs only the NVIDIA driver and container toolkit for the GPU worker).
FROM python:3.11-slim

# Triton compiles its launcher stubs with a C compiler when a kernel first runs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
ARG TORCH_SPEC="torch>=2.11"
RUN pip install --no-cache-dir "${TORCH_SPEC}"
# Only what the install needs: not `COPY . .`, which would take ./models (the checkpoints the
# quantizer mounts, see docker-compose.yml) and `qctl up`'s .qserve-up/ into the image.
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY shared/ shared/
COPY services/ services/
COPY qctl/ qctl/
RUN pip install --no-cache-dir . \
 && python -c "import shared.rpc.qserve.v1.worker_pb2"

# Non-root at run time; /data holds scratch space and downloaded artifacts.
RUN useradd --create-home --uid 10001 qserve && mkdir -p /data && chown qserve /data
USER qserve
ENV HOME=/home/qserve
