"""``steptap serve --workers N --public-url URL`` (issue 25, item 6): a session is served by one worker, so
the URLs handed to agents are per worker; with a public URL (the TLS front the security doc requires) they
must be derived from it, never the workers' plain ``http://HOST:PORT+1+i`` that bypass the front. A URL with
``{i}`` or ``{port}`` gives each worker its own; a plain one is refused with a clear error (the front cannot
route a session to its worker)."""

from __future__ import annotations

import subprocess
import sys

from steptap.middleware.server.serve import config_from_args
from steptap.middleware.server.workers import worker_urls

STEPTAP = [sys.executable, "-m", "steptap.middleware.cli"]


def test_worker_urls_derive_from_a_public_url_template() -> None:
    cfg = config_from_args(["--backend", "http://127.0.0.1:9", "--port", "8400",
                            "--public-url", "https://w{i}.example.com"])
    assert worker_urls(cfg, 2) == ["https://w0.example.com", "https://w1.example.com"]
    cfg = config_from_args(["--backend", "http://127.0.0.1:9", "--port", "8400",
                            "--public-url", "https://front.example.com:{port}/"])
    assert worker_urls(cfg, 2) == ["https://front.example.com:8401", "https://front.example.com:8402"]
    cfg = config_from_args(["--backend", "http://127.0.0.1:9", "--port", "8400"])
    assert worker_urls(cfg, 2) == ["http://127.0.0.1:8401", "http://127.0.0.1:8402"]


def test_a_plain_public_url_with_workers_is_refused() -> None:
    out = subprocess.run([*STEPTAP, "serve", "--workers", "2", "--port", "18400", "--backend",
                          "http://127.0.0.1:9",
                          "--public-url", "https://front.example.com"],
                         capture_output=True, text=True, timeout=60, env={"STEPTAP_CONTROL_TOKEN": "t" * 32,
                                                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--public-url" in out.stderr and "{i}" in out.stderr and "Traceback" not in out.stderr, out.stderr
