# syntax=docker/dockerfile:1
# The gpuslice node agent image: `gpuslice agent` plus the interposer library it installs on
# each GPU node (/opt/gpuslice/libgpuslice.so). Build from the repository root:
#
#   docker build -f scripts/images/agent.Dockerfile -t ghcr.io/gpuslice/agent:0.1.0 .
#
# The library is preloaded into every GPU container, whatever its base image, so it is built
# against an old glibc (2.28: RHEL/Rocky 8, Debian 10, Ubuntu >= 18.10). Built on a newer one
# it could need symbol versions an older image lacks; the dynamic loader then skips
# ld.so.preload entries it cannot load, and the container would run without its caps.

ARG LIB_BUILDER=rockylinux:8
ARG MAKE_TARGETS=lib

FROM ${LIB_BUILDER} AS library
ARG MAKE_TARGETS
RUN dnf install -y --setopt=install_weak_deps=False gcc make binutils \
    && dnf clean all
WORKDIR /src
COPY interposer ./interposer
# Fail the build if the library needs a glibc symbol version newer than 2.28 (built on
# glibc 2.36 it needs 2.34: dlopen, pthread_once, pthread_mutex_consistent, ...).
RUN make -C interposer ${MAKE_TARGETS} \
    && test -f interposer/build/libgpuslice.so \
    && ! objdump -T interposer/build/libgpuslice.so | grep -E 'GLIBC_2\.(29|[3-9][0-9])'

FROM python:3.11-slim AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY webhook ./webhook
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels gpuslice
COPY --from=library --chmod=0755 /src/interposer/build/libgpuslice.so /opt/gpuslice/libgpuslice.so
# Runs as root (the chart says why): it writes the host's /usr/local/gpuslice.
EXPOSE 9400
ENTRYPOINT ["gpuslice"]
CMD ["agent", "--help"]
