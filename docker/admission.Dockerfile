# kvgate admission service: `kvgate admission-service --config /etc/kvgate/admission.yaml`.
# kvgate with its base dependencies and the `s3` extra (the gateway's batch files in an object
# store): no torch, no demo broker, no plotting, no kopf.
# Build from the repository root:
#   docker build -f docker/admission.Dockerfile -t kvgate-admission:0.1.0 .
# BASE_IMAGE: any image with Python >= 3.11, or a Debian/Ubuntu one to which python.sh adds it
# (e.g. a root file system brought in with `docker import`).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG UV_VERSION=0.13.8
COPY docker/python.sh /usr/local/bin/kvgate-python.sh
RUN sh /usr/local/bin/kvgate-python.sh build
# uv resolves and installs; it lives in its own environment and stays in this stage.
RUN python3 -m venv /opt/uv \
 && /opt/uv/bin/python -m pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}" \
 && python3 -m venv --without-pip /opt/kvgate
ENV UV_NO_CACHE=1 UV_PYTHON=/opt/kvgate/bin/python UV_PROJECT_ENVIRONMENT=/opt/kvgate \
    UV_COMPILE_BYTECODE=1
# Dependencies first, at the versions in uv.lock (a layer that changes only with the lock),
# then kvgate itself.
COPY pyproject.toml uv.lock /src/
RUN /opt/uv/bin/uv sync --project /src --frozen --no-install-project --extra s3
COPY README.md LICENSE /src/
COPY kvgate /src/kvgate
RUN /opt/uv/bin/uv pip install --no-deps /src

FROM ${BASE_IMAGE}
COPY docker/python.sh /usr/local/bin/kvgate-python.sh
RUN sh /usr/local/bin/kvgate-python.sh runtime && rm /usr/local/bin/kvgate-python.sh
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="kvgate-admission" \
      org.opencontainers.image.description="kvgate admission service: Kafka in, scheduling, results out"
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["kvgate"]
CMD ["admission-service", "--config", "/etc/kvgate/admission.yaml"]
