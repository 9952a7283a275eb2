#!/bin/sh
# Make the base image ready for a kvgate image stage, whatever the base:
#   python.sh build     python3 that can create virtual environments (python3 -m venv)
#   python.sh runtime   python3, and the unprivileged user 10001 (kvgate) in /etc/passwd
#   python.sh runtime-compiler
#                       the same plus a C compiler and Python's headers: Triton compiles its
#                       GPU driver glue with them the first time a kernel runs
# Official python images have both already; Debian and Ubuntu bases (a CUDA image, or a root
# file system brought in with `docker import`) get the missing packages from apt. Python must be
# 3.11 or newer (kvgate's requires-python).
set -eu

stage=${1:?usage: python.sh build|runtime|runtime-compiler}
uid=10001

can_make_venv() {
    probe=$(mktemp -d)
    python3 -m venv "$probe/venv" >/dev/null 2>&1
    status=$?
    rm -rf "$probe"
    return $status
}

missing=""
if ! command -v python3 >/dev/null 2>&1; then
    missing="python3"
fi
if [ "$stage" = build ] && { [ -n "$missing" ] || ! can_make_venv; }; then
    missing="python3 python3-venv"
fi
if [ "$stage" = runtime-compiler ]; then
    command -v gcc >/dev/null 2>&1 || missing="$missing gcc libc6-dev"
    headers=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
    [ -n "$headers" ] && [ -f "$headers/Python.h" ] || missing="$missing python3-dev"
fi
if [ -n "$missing" ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "python.sh: the base image lacks $missing and has no apt-get" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends $missing
    rm -rf /var/lib/apt/lists/*
fi

python3 - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"python.sh: kvgate needs Python 3.11 or newer, the base has {sys.version.split()[0]}")
PY

if [ "$stage" != build ]; then
    # A name for the numeric user the pods run as: some libraries look the user up.
    grep -q "^[^:]*:[^:]*:$uid:" /etc/passwd || echo "kvgate:x:$uid:$uid:kvgate:/tmp:/usr/sbin/nologin" >> /etc/passwd
    grep -q "^[^:]*:[^:]*:$uid:" /etc/group || echo "kvgate:x:$uid:" >> /etc/group
fi
