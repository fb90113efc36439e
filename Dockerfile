# syntax=docker/dockerfile:1
# The image every rendered pod runs (deploy/k8s, `meridian deploy k8s --image`):
#   docker build -t meridian:0.1.0 .
# Stage 1 builds the project's wheel and its runtime dependencies' wheels; stage 2
# installs only those, from that directory, with no index (what tests/deploy/test_wheel.py
# does into a fresh virtualenv). The embedded Redis (the `embedded-redis` extra, for
# `meridian up`) and the dev tools (`dev` extra: pytest, grpcio-tools, linters) are not in it.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY common/ common/
COPY global_lb/ global_lb/
COPY regional_lb/ regional_lb/
COPY local_lb/ local_lb/
COPY sim/ sim/
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels meridian-lb \
    && pip uninstall --yes pip setuptools wheel \
    && groupadd --system --gid 10001 meridian \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp meridian
# Numeric, so the kubelet can check runAsNonRoot without reading /etc/passwd.
USER 10001:10001
# V2 gRPC 8001, OpenAI HTTP 8000, ops HTTP (/metrics, /readyz) 8002: the conventional ports.
EXPOSE 8000 8001 8002
ENTRYPOINT ["meridian"]
CMD ["--help"]
