"""Helpers the serve benchmarks share: `osprey serve` started and stopped around a block, and the
GPU's name and the binary's commit for the results. Needs: requests."""
import argparse
import contextlib
import subprocess
import time

import requests


def arguments(description, port):
    """The flags every serve benchmark takes: the binary, the checkpoint, the backend, the port
    and where to write the results."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--osprey", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--out", help="write the results as JSON here")
    return ap


@contextlib.contextmanager
def serving(osprey, model, backend, port, *args):
    """Starts `osprey serve` on 127.0.0.1:`port` (extra flags in `args`), waits until /health
    answers and yields the base URL; stops the server on leaving."""
    server = subprocess.Popen([osprey, "serve", "--model", model, "--backend", backend,
                               "--port", str(port), *args])
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if requests.get(base + "/health", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        else:
            raise SystemExit("server did not come up")
        yield base
    finally:
        server.terminate()
        server.wait(timeout=60)


def post_json(base, path, body):
    """POSTs `body` as JSON to `base` + `path` and returns the answer's JSON; an HTTP error raises."""
    r = requests.post(base + path, json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def binary_commit(osprey):
    """The commit the binary was built from, as `osprey --version` reports it: "osprey 0.1.0 (2c0de52)"."""
    try:
        version = subprocess.run([osprey, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    inside = version.strip().rpartition("(")[2].rstrip(")")
    return inside or "unknown"
