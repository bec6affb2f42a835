# syntax=docker/dockerfile:1
# The gpuslice service image: admission webhook, scheduler extender and TLS bootstrap
# (`gpuslice serve`, `python -m webhook.bootstrap`). Build from the repository root:
#
#   docker build -f scripts/images/webhook.Dockerfile -t ghcr.io/gpuslice/webhook:0.1.0 .
#
# The chart runs it as UID/GID 10001 with a read-only root filesystem.

FROM python:3.11-slim AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY webhook ./webhook
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels gpuslice \
    && groupadd --system --gid 10001 gpuslice \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin gpuslice
USER 10001:10001
EXPOSE 8443
ENTRYPOINT ["gpuslice"]
CMD ["--help"]
