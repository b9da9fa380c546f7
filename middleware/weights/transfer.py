"""Full weights by collective transfer: the proxy's half (``POST /admin/weights {"transfer": {...}}``).

The learner (``steptap.learner.transfer``) hosts a torch.distributed store and broadcasts every tensor from
rank 0; the swapper holds, drains and pauses as for a disk swap, then each replica's vLLM workers join the group
through vLLM's weight-transfer routes (the ``steptap`` engine, installed into vLLM's venv by ``steptap vllm``):
``/init_weight_transfer_engine`` (rendezvous) -> ``/start_weight_update`` -> ``/update_weights`` (receives while
the learner sends) -> ``/finish_weight_update`` -> ``/shutdown_weight_transfer_engine``. Every replica joins
the one group at once (ranks ``1..``), so one broadcast feeds them all.

The learner's store is sealed with ``secret``, made for this one transfer (``steptap_sealed_store``): it
reaches vLLM only through this authenticated body and vLLM's admin route, never a log or an error message.

A transfer that fails once a replica started loading (the learner died, a timeout) leaves that replica with
some new and some old tensors. It never serves them: it reloads the last weights on disk (``reload_weights``
from the swapper's ``path``). Those are the current version's weights when the current version came from disk;
when it came from a transfer there is no copy of it on disk, so ``settle`` makes the disk weights a new version
of their own on every replica (nothing serves two sets of weights under one version) and says so in the error.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol

import msgspec
from steptap.middleware.model_files import tensor_shapes
from steptap.middleware.weights.checks import SwapError

logger = logging.getLogger("steptap.weights")

MAX_TENSORS = 1_000_000  # a body bound; real models have thousands
DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64",
                    "float8_e4m3fn", "float8_e5m2", "bool"})


class Transfer(msgspec.Struct, forbid_unknown_fields=True):
    """Where the learner's group is and what it will send, in order."""

    address: str
    port: int
    secret: str  # seals the learner's store: without it no process joins the group
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = 120.0  # the workers' bound on the rendezvous and on each tensor

    def __repr__(self) -> str:  # never the secret
        return f"Transfer({self.address}:{self.port}, {len(self.names)} tensors, {self.backend})"

    def check(self) -> None:
        if not 0 < self.port < 65536:
            raise SwapError(400, f"transfer.port {self.port} is not a TCP port", "invalid_request")
        if not 32 <= len(self.secret) <= 256 or not self.secret.isascii() or not self.secret.isalnum():
            raise SwapError(400, "transfer.secret must be 32..256 letters or digits", "invalid_request")
        if not 1 <= self.timeout_s <= 3600:
            raise SwapError(400, "transfer.timeout_s must be within 1..3600", "invalid_request")
        n = len(self.names)
        if not 0 < n <= MAX_TENSORS or len(self.dtype_names) != n or len(self.shapes) != n:
            raise SwapError(400, "transfer.names, dtype_names and shapes must be equally long (1.."
                                 f"{MAX_TENSORS})", "invalid_request")
        if len(set(self.names)) != n:
            raise SwapError(400, "transfer.names repeats a tensor", "invalid_request")
        bad = sorted(set(self.dtype_names) - DTYPES)
        if bad:
            raise SwapError(400, f"transfer.dtype_names: unknown dtype {bad[0]!r}", "invalid_request")
        if any(d < 0 for s in self.shapes for d in s):
            raise SwapError(400, "transfer.shapes: negative dimension", "invalid_request")

    def check_fits(self, reference: str | None) -> None:
        """The served model's tensor names and shapes (its safetensors headers), as a disk swap checks: vLLM
        sets its parameters aside before loading, so a mismatch found there would leave it unusable."""
        if reference is None:
            return
        try:
            ref = tensor_shapes(reference)
        except (OSError, ValueError):
            return  # not a readable local directory (vLLM elsewhere): vLLM's own loader checks
        if not ref:
            return
        sent = dict(zip(self.names, self.shapes, strict=True))
        missing = sorted(ref.keys() - sent.keys())
        extra = sorted(sent.keys() - ref.keys())
        wrong = sorted(k for k in ref.keys() & sent.keys() if list(ref[k]) != list(sent[k]))
        if missing or extra or wrong:
            parts = [f"shape differs for {k} {sent[k]} (served: {list(ref[k])})" for k in wrong[:3]]
            parts += [f"missing {', '.join(missing[:3])}"] if missing else []
            parts += [f"unknown {', '.join(extra[:3])}"] if extra else []
            raise SwapError(400, f"the transfer does not fit the served model ({reference}): " + "; ".join(parts),
                            "weights_mismatch")

    def update_info(self) -> dict[str, Any]:
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}


class Caller(Protocol):
    async def __call__(self, backend: str, method: str, route: str, body: dict[str, Any] | None = None) -> Any: ...


class TransferFailed(SwapError):
    """A replica's part failed; ``touched``: it had started loading (its weights are mixed until reloaded)."""

    def __init__(self, message: str, touched: bool) -> None:
        super().__init__(502, message, "transfer_failed")
        self.touched = touched


async def plan(call: Caller, targets: list[str]) -> tuple[dict[str, int], int]:
    """Each replica's first rank in the group (the learner is 0) and the group's size: ask each its world."""
    offsets, rank = {}, 1
    for b in targets:
        info = await call(b, "GET", "/get_world_size?include_dp=true")
        size = int(info.get("world_size", 1)) if isinstance(info, dict) else 1
        offsets[b], rank = rank, rank + max(1, size)
    return offsets, rank


async def receive(call: Caller, backend: str, spec: Transfer, rank_offset: int, world_size: int,
                  version: int) -> None:
    """One replica joins the group, receives every tensor and loads it; raises ``TransferFailed``."""
    init = {"master_address": spec.address, "master_port": spec.port, "secret": spec.secret,
            "rank_offset": rank_offset, "world_size": world_size, "backend": spec.backend,
            "timeout_s": spec.timeout_s}
    touched = False
    try:
        await call(backend, "POST", "/init_weight_transfer_engine", {"init_info": init})
        await call(backend, "POST", "/start_weight_update")
        touched = True
        await call(backend, "POST", "/update_weights", {"update_info": spec.update_info()})
        await call(backend, "POST", "/finish_weight_update", {"weight_version": str(version)})
    except SwapError as exc:
        raise TransferFailed(f"weight transfer to {backend} failed: {exc.message}", touched) from None
    finally:
        try:  # the group is one transfer's: a later one makes its own
            await call(backend, "POST", "/shutdown_weight_transfer_engine")
        except SwapError as exc:
            logger.warning("could not release the transfer group on %s: %s", backend, exc.message)


async def reload_from_disk(call: Caller, backend: str, path: str | None) -> str | None:
    """Put the last weights on disk back into a replica a transfer left mixed; the error, or None."""
    if path is None:
        return f"{backend} holds mixed weights and no weights on disk are known to reload"
    try:
        await call(backend, "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
    except SwapError as exc:
        return f"{backend} could not reload {path} after a failed transfer: {exc.message}"
    return None


def transfer_error(failed: dict[str, str], what_now: str) -> SwapError:
    return SwapError(502, "; ".join(failed.values()) + f". {what_now}", "transfer_failed")
