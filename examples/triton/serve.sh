#!/usr/bin/env bash
# Serve a model repository with the tritonserver bundled in the nvidia-pytriton wheel (python backend).
#   examples/triton/serve.sh --repo triton-repo [--grpc-port 8001] [--http-port 8000]
# Runs in the server environment that `make triton-env` builds (override with SPECC_TRITON_ENV);
# the launcher execs tritonserver, so this script's PID is the server's PID. Stop it with Ctrl-C or
# `kill PID`.
set -euo pipefail
env_dir="${SPECC_TRITON_ENV:-$(cd "$(dirname "$0")/../.." && pwd)/.venv-triton}"
if [ ! -x "$env_dir/bin/python" ]; then
    echo "serve.sh: no server environment at $env_dir; build it with \`make triton-env\`" >&2
    exit 2
fi
exec "$env_dir/bin/python" -m specc.triton.local_server "$@"
