"""Publishing full weights to vLLM by a collective transfer instead of a directory on disk.

``weight_sync = "collective"`` (LearnerConfig). The learner is rank 0 of a torch.distributed group made for
this one transfer (no global default group): it hosts a TCPStore on a free port and asks the proxy to swap
with ``POST /admin/weights {"transfer": {...}}``. The proxy does what it does for a disk swap (hold new calls,
drain, pause every replica) and then has each vLLM worker join the group through vLLM's weight-transfer routes
(the ``steptap`` engine: ``middleware/launch/vllm_plugin``), while this side broadcasts every tensor from rank
0. When the workers have loaded them the proxy resets the prefix cache, persists the version and resumes; the
HTTP answer carries the new version. The backend is ``gloo`` for CPU tensors and ``nccl`` for CUDA ones: the
same code path.

The learner learns the group's size from the store (each worker writes it as it joins), so it needs to know
nothing of the replicas. Every wait is bounded: the proxy's answer (an error too) ends the wait for workers,
and the group's ``timeout_s`` bounds each broadcast.

Strangers: the store listens only on ``address`` (the interface vLLM reaches this host by; 127.0.0.1 for a
local vLLM), and it is sealed (``steptap_sealed_store``) with a random secret made for this one transfer and
handed to vLLM only inside the authenticated ``POST /admin/weights`` body: a process without it can neither
join the group nor plant a value the learner believes. Every failure of this path is a ``PublishError`` (the
daemon reports it and goes on), never an exception that ends the learner.

LoRA adapters are not sent this way: vLLM's transfer loads base weights in place, while an adapter is a
separate model vLLM loads by path (``/v1/load_lora_adapter``); LoRA keeps publishing through disk.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steptap.learner.publish import PublishError
from steptap.middleware.client import SteptapError, SyncSteptapClient
from steptap.middleware.launch.vllm_plugin.steptap_sealed_store import SealedStore

logger = logging.getLogger("steptap.learner.transfer")

PREFIX = "steptap-transfer/"  # as the vLLM plugin's (middleware/launch/vllm_plugin/steptap_vllm_plugin.py)
WORLD_KEY = "world_size"
MAX_WORLD = 4097  # the learner and up to 4096 vLLM workers: a larger size read from the store is refused


def named_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors a full-weights publish sends: the HF state dict (the names ``save_pretrained`` writes)."""
    model = getattr(model, "_orig_mod", model)
    if hasattr(model, "peft_config"):
        raise TypeError("a peft model publishes its adapter through disk (weight_sync = 'disk')")
    return [(name, t.detach()) for name, t in model.state_dict().items()]


def transfer_spec(weights: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What vLLM's workers are told to expect, in order (the proxy checks it before anything pauses)."""
    return {
        "names": [n for n, _ in weights],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
    }


def _route_address(proxy_url: str) -> str:
    """The address vLLM's workers reach this host by: the one this host uses toward the proxy."""
    from urllib.parse import urlsplit

    host = urlsplit(proxy_url).hostname if not proxy_url.startswith("unix:") else None
    if not host or host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]


def send_collective(
    weights: list[tuple[str, torch.Tensor]],
    proxy_url: str,
    control_token: str,
    *,
    version: int | None = None,
    address: str = "",
    timeout_s: float = 120.0,
    swap_timeout_s: float = 900.0,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Swap ``weights`` into the proxy's vLLM by broadcast; return the new policy version.

    Raises ``PublishError`` when the proxy refuses or fails the swap (its message says what the replicas serve
    now) or cannot be reached. ``progress(sent, total)`` is called after each tensor."""
    if not weights:
        raise ValueError("no tensors to send")
    cuda = weights[0][1].is_cuda
    if any(t.is_cuda != cuda for _, t in weights):
        raise ValueError("the tensors must all be on CUDA or all on CPU")
    backend = "nccl" if cuda else "gloo"
    try:
        return _send(weights, proxy_url, control_token, backend, version,
                     address or _route_address(proxy_url),
                     timeout_s, swap_timeout_s, progress)
    except PublishError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's store and group errors, a bad address: report, never die
        raise PublishError(f"the weight transfer failed on the learner's side: {type(exc).__name__}: {exc}",
                           None, "transfer_failed") from exc


def _listen(address: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's store, listening on ``address`` only (a TCPStore master alone binds every interface)."""
    family, kind, proto, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(where)
        sock.listen(128)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns it now
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=fd)


def _world(store: SealedStore) -> int:
    raw = store.get(WORLD_KEY)
    text = raw.decode("ascii", "replace").strip()
    if not text.isdigit() or not 2 <= int(text) <= MAX_WORLD:
        raise PublishError(f"the transfer's group size {text[:20]!r} is not within 2..{MAX_WORLD}", None,
                           "transfer_failed")
    return int(text)


def _send(weights: list[tuple[str, torch.Tensor]], proxy_url: str, control_token: str, backend: str,
          version: int | None, address: str, timeout_s: float, swap_timeout_s: float,
          progress: Callable[[int, int], None] | None) -> int:
    td = datetime.timedelta(seconds=timeout_s)
    store = _listen(address, td)
    secret = secrets.token_hex(32)  # this transfer's: only the proxy (and through it vLLM) learns it
    body = _swap_body(weights, address, store.port, secret, backend, timeout_s, version)
    t0 = time.monotonic()
    swap = _SwapCall(proxy_url, control_token, body, swap_timeout_s)
    group = None
    send_error: Exception | None = None
    try:
        prefixed = SealedStore(dist.PrefixStore(PREFIX, store), secret)
        if _joined(prefixed, swap, t0, swap_timeout_s):
            world = _world(prefixed)
            try:
                group = _group(prefixed, world, backend, td)
                _broadcast(group, weights, world, backend, progress)
            except (RuntimeError, PublishError) as exc:  # a worker left or never joined, a spoiled store
                send_error = exc
        swap.join()
    finally:
        if group is not None:
            group.shutdown()
    return swap.version(send_error)


def _swap_body(weights: list[tuple[str, torch.Tensor]], address: str, port: int, secret: str, backend: str,
               timeout_s: float, version: int | None) -> dict[str, Any]:
    """``POST /admin/weights``'s body: where the store listens, its secret, and what the workers receive."""
    body: dict[str, Any] = {"transfer": {"address": address, "port": port, "secret": secret,
                                         "backend": backend, "timeout_s": timeout_s,
                                         **transfer_spec(weights)}}
    if version is not None:
        body["version"] = int(version)
    return body


class _SwapCall:
    """The proxy's swap, asked on a thread of its own as soon as it is made: the proxy answers only once the
    workers loaded every tensor (or it failed), and they receive them from the broadcast this side runs
    meanwhile."""

    def __init__(self, proxy_url: str, control_token: str, body: dict[str, Any], timeout_s: float) -> None:
        self.proxy_url = proxy_url
        self.timeout_s = timeout_s
        self.answer: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._ask, args=(control_token, body),
                                       name="steptap-transfer-swap", daemon=True)
        self.thread.start()

    def _ask(self, control_token: str, body: dict[str, Any]) -> None:
        try:
            self.answer["version"] = SyncSteptapClient(self.proxy_url, control_token).transfer_weights(
                body, timeout_s=self.timeout_s)
        except BaseException as exc:  # noqa: BLE001 - handed to the sending thread (version)
            self.answer["error"] = exc

    def answered(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        self.thread.join(self.timeout_s)

    def version(self, send_error: Exception | None) -> int:
        """The new policy version, or the ``PublishError`` that says which side failed and how."""
        if self.thread.is_alive():
            raise PublishError(f"the proxy did not answer the transfer swap in {self.timeout_s:g} s", None,
                               "proxy_unreachable")
        err = self.answer.get("error")
        if isinstance(err, SteptapError):
            raise PublishError(f"weight transfer refused ({err.status}): {err.message}", err.status, err.code)
        if isinstance(err, OSError):
            raise PublishError(f"proxy {self.proxy_url} unreachable for the weight transfer: {err}", None,
                               "proxy_unreachable")
        if err is not None:
            raise PublishError(f"the weight transfer swap failed: {type(err).__name__}: {err}", None,
                               "transfer_failed")
        if send_error is not None:  # the proxy answered success though this side failed: never expected
            raise PublishError(f"the weight transfer failed on the learner's side: {send_error}", None,
                               "transfer_failed")
        return int(self.answer["version"])


def _joined(store: SealedStore, swap: _SwapCall, t0: float, swap_timeout_s: float) -> bool:
    """Wait for the first worker to join (the proxy drains and pauses first): True; False when the proxy
    answered first (a refusal, a failure)."""
    while not store.check([WORLD_KEY]):
        if swap.answered():
            return False
        if time.monotonic() - t0 > swap_timeout_s:
            raise PublishError(f"no vLLM worker joined the transfer in {swap_timeout_s:g} s", None,
                               "transfer_timeout")
        time.sleep(0.02)
    return True


def _broadcast(group: Any, weights: list[tuple[str, torch.Tensor]], world: int, backend: str,
               progress: Callable[[int, int], None] | None) -> None:
    """Every tensor from rank 0, in the order ``transfer_spec`` announced."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    t_send = time.monotonic()
    for i, (_, tensor) in enumerate(weights):
        send = tensor if tensor.is_contiguous() else tensor.contiguous()
        group.broadcast([send], opts).wait()
        if progress is not None:
            progress(i + 1, len(weights))
    logger.info("sent %d tensors to %d vLLM workers over %s in %.3f s", len(weights), world - 1,
                backend, time.monotonic() - t_send)


def _group(store: Any, world: int, backend: str, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, 0, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, 0, world, opts)

