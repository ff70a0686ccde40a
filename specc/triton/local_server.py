"""Run the real `tritonserver` that the nvidia-pytriton wheel bundles (Triton 2.51, python backend only).

The launcher must run in the Python environment Triton's python-backend stub will use: the stub
links the system `libpython3.11`, so that environment is a venv of the system python3.11 with
numpy < 2, nvidia-pytriton and specc installed (`make triton-env` builds it as .venv-triton):

    .venv-triton/bin/python -m specc.triton.local_server --repo triton-repo --grpc-port 8001 --http-port 8000

The launcher replaces itself with tritonserver (same PID). `LocalServer` starts it from any
other Python process on free 127.0.0.1 ports, waits for readiness and stops it by its PID.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import SpeccError


def _pytriton() -> Path:
    try:
        import pytriton
    except ImportError:
        raise SpeccError(f"nvidia-pytriton is not installed in {sys.prefix}; build the server environment with "
                         "`make triton-env` and run this launcher with .venv-triton/bin/python") from None
    return Path(pytriton.__file__).parent


def prepare(workdir: Path) -> Path:
    """Copy the wheel's backends and caches into workdir, with the python-backend stub of this Python."""
    dist = _pytriton() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SpeccError(f"nvidia-pytriton has no python-backend stub for Python {version}")
    for part in ("backends", "caches"):
        shutil.copytree(dist / part, workdir / part, dirs_exist_ok=True)
    shutil.copy2(stub, workdir / "backends" / "python" / stub.name)
    return dist / "bin" / "tritonserver"


def server_command(repo: Path, workdir: Path, grpc_port: int, http_port: int) -> tuple[list[str], dict[str, str]]:
    """The tritonserver command line (listening on 127.0.0.1 only) and its environment."""
    binary = prepare(workdir)
    args = [
        str(binary), "--model-repository", str(repo.resolve()),
        "--backend-directory", str(workdir / "backends"), "--cache-directory", str(workdir / "caches"),
        "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--http-address", "127.0.0.1", "--http-port", str(http_port),
        "--allow-metrics", "false", "--exit-timeout-secs", "10",
        # shared-memory names unique to this server, so servers started side by side do not collide
        "--backend-config", f"python,shm-region-prefix-name=specc{os.getpid()}_",
    ]
    env = dict(os.environ)
    libs = _pytriton().parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
    # The stub finds its Python environment through the first python3 on PATH: this venv's.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return args, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specc.triton.local_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="the model repository (`specc triton BUNDLE --repo DIR`)")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--workdir", type=Path, help="where the server's backends are prepared (default: a new temp dir)")
    args = parser.parse_args(argv)
    try:
        if not args.repo.is_dir():
            raise SpeccError(f"model repository {args.repo} does not exist; write one with `specc triton BUNDLE --repo DIR`")
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="specc-tritonserver-"))
        command, env = server_command(args.repo, workdir, args.grpc_port, args.http_port)
    except SpeccError as exc:
        print(f"specc: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execve(command[0], command, env)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """tritonserver on free 127.0.0.1 ports, started through `launcher` (a command list that ends
    in the launcher's arguments are appended to), in its own process group; stopped by its PID."""

    def __init__(self, launcher: list[str], repo: Path, log: Path, workdir: Path):
        self.launcher, self.repo, self.log_path, self.workdir = launcher, Path(repo), Path(log), Path(workdir)
        self.grpc_port = free_port()
        self.http_port = free_port()
        while self.http_port == self.grpc_port:
            self.http_port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def start(self, models: list[str], timeout: float = 180.0) -> None:
        """Start the server and wait until it and `models` are ready (raises with the log's tail if not)."""
        import tritonclient.grpc as grpcclient

        args = ["--repo", str(self.repo), "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
                "--workdir", str(self.workdir)]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.launcher + args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        with grpcclient.InferenceServerClient(self.grpc_url) as client:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"tritonserver exited with code {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if client.is_server_ready() and all(client.is_model_ready(m) for m in models):
                        return
                except Exception:  # not listening yet
                    pass
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tritonserver was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the server by its PID and wait (it unloads its models and stops their stubs);
        SIGKILL it if it lingers, and any stub left in its process group."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group is this server's own (start_new_session)
        except ProcessLookupError:
            pass
        return self.process.returncode

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
