# pdq: one image for every role (the command picks the role).
#   docker build -t pdq:0.1.0 .
#   docker run --rm pdq:0.1.0 pdq gateway --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PDQ_CACHE_DIR=/var/cache/pdq
WORKDIR /app
# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
# For GPUs, build with --build-arg TORCH="torch==2.13.0" --build-arg TORCH_INDEX=<your CUDA wheel index>.
ARG TORCH="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
RUN pip install --no-cache-dir "$TORCH" --index-url "$TORCH_INDEX"
COPY pyproject.toml README.md ./
COPY pdq ./pdq
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY protos ./protos
RUN pip install --no-cache-dir . \
 && python -c "from pdq.model.loader import resolve_model; print(resolve_model('builtin'))"
USER 65534:65534
CMD ["pdq", "--help"]
