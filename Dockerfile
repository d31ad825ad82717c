# syntax=docker/dockerfile:1
#
# healthagent container image: `healthagent run` as the DaemonSet agent (deploy/).
#
#   docker build -t <registry>/healthagent:0.1.0 .
#
# Two stages: the first builds wheels for the package and its dependencies from this repository,
# the second installs them into a clean slim image with no compiler and no pip cache.
#
# Privileges (docs/install.md, "Privileges"): the image's default user is the unprivileged
# `healthagent` (uid 10001), enough for `healthagent check`, `classify` and `explain`. The
# DaemonSet runs the agent as uid 0 with every capability dropped except CAP_SYSLOG, because
#   - the kernel log needs CAP_SYSLOG where kernel.dmesg_restrict=1, and Kubernetes gives added
#     capabilities to uid 0 only (no ambient capabilities for other users);
#   - the state hostPath /var/lib/healthagent is created by the kubelet as root:root 0755.
# Opening /dev/kmsg also needs device-cgroup access that no capability grants (only a privileged
# container has it): docs/install.md says what the agent does without it and how to choose.
# NVML needs no privilege: the NVIDIA container runtime injects libnvidia-ml.so.1 and the
# /dev/nvidia* device nodes (mode 0666) when NVIDIA_VISIBLE_DEVICES is set.

# Pinned by tag; for a reproducible build pass a digest:
#   --build-arg PYTHON_IMAGE=python:3.12-slim-bookworm@sha256:<digest>
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY healthagent ./healthagent
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG SOURCE_URL=""
ARG REVISION=""
LABEL org.opencontainers.image.title="healthagent" \
      org.opencontainers.image.description="GPU, EFA and InfiniBand/RoCE health agent for Kubernetes training clusters: detect, explain, taint, export." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${REVISION}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels "healthagent==${VERSION}" \
    && useradd --system --uid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin healthagent

USER 10001
# 9410: /metrics and probes (the pod's own port); 9412: the training intake (the hostPort)
EXPOSE 9410 9412
ENTRYPOINT ["healthagent", "run"]
