"""llama-server for the side-by-side scripts in this directory (`agreement.py`,
`prompt_cache.py`): started on a free port with 2 threads and one slot, stopped on leaving."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator


@contextlib.contextmanager
def llama_server(bin_dir: str, path: str, args: list[str], repack: bool = True) -> Iterator[str]:
    """`llama-server -m path ARGS` (the environment's, plus LLAMA_ARG_REPACK=0 where `repack`
    is False: its repacked matmul crashes on AMX Xeons); its base URL once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, **({} if repack else {"LLAMA_ARG_REPACK": "0"}))
    proc = subprocess.Popen(
        [f"{bin_dir}/llama-server", "-m", path, "--port", str(port), "-t", "2", "-np", "1",
         *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while not _healthy(url):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"llama-server did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def post(url: str, body: dict) -> dict:
    """POST `body` as JSON; the JSON answer."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())
