"""The server every client test talks to: `osprey serve` on a tiny synthetic model, started once.

Run by .ci/run:  OSPREY_BIN=target/debug/osprey python -m pytest tests/python
"""
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

BIN = os.environ.get("OSPREY_BIN", "target/debug/osprey")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def osprey_server():
    """Base URL of the server; its API key is "test-key"."""
    tmp = tempfile.mkdtemp(prefix="osprey-clients-")
    model = os.path.join(tmp, "tiny")
    subprocess.run([BIN, "synth", "--preset", "tiny", "--seed", "3", "--out", model], check=True)
    port = free_port()
    proc = subprocess.Popen([BIN, "serve", "--model", model, "--port", str(port), "--served-model-name", "tiny",
                             "--api-key", "test-key", "--default-max-tokens", "16"])
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if json.load(r)["status"] == "ok":
                    break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        shutil.rmtree(tmp)
        pytest.fail("server did not come up")
    yield base
    proc.terminate()
    try:
        assert proc.wait(timeout=30) == 0, "clean shutdown on SIGTERM"
    finally:
        shutil.rmtree(tmp)
