"""Full weights by collective transfer: the proxy's half (``POST /admin/weights {"transfer": {...}}``).

The learner (``steptap.learner.transfer``) hosts a torch.distributed store and broadcasts every tensor from
rank 0; the swapper holds, drains and pauses as for a disk swap, then each replica's vLLM workers join the
group through vLLM's weight-transfer routes (the ``steptap`` engine, installed into vLLM's venv by ``steptap
vllm``): ``/init_weight_transfer_engine`` (rendezvous) -> ``/start_weight_update`` -> ``/update_weights``
(receives while the learner sends) -> ``/finish_weight_update`` -> ``/shutdown_weight_transfer_engine``. Every
replica joins the one group at once (ranks ``1..``), so one broadcast feeds them all.

The learner's store is sealed with ``secret``, made for this one transfer (``steptap_sealed_store``): it
reaches vLLM only through this authenticated body and vLLM's admin route, never a log or an error message.

A transfer that fails once a replica started loading (the learner died, a timeout) leaves that replica with
some new and some old tensors. It never serves them: it reloads the last weights on disk (``reload_weights``
from the swapper's ``path``). Those are the current version's weights when the current version came from disk;
when it came from a transfer there is no copy of it on disk, so ``settle`` makes the disk weights a new
version of their own on every replica (nothing serves two sets of weights under one version) and says so in
the error.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec

from steptap.middleware.backend.client import BackendClient
from steptap.middleware.exceptions import DomainError, SwapError, SwapRefused
from steptap.middleware.model_files import tensor_shapes

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
            raise SwapRefused(f"transfer.port {self.port} is not a TCP port", "invalid_request")
        if not 32 <= len(self.secret) <= 256 or not self.secret.isascii() or not self.secret.isalnum():
            raise SwapRefused("transfer.secret must be 32..256 letters or digits", "invalid_request")
        if not 1 <= self.timeout_s <= 3600:
            raise SwapRefused("transfer.timeout_s must be within 1..3600", "invalid_request")
        n = len(self.names)
        if not 0 < n <= MAX_TENSORS or len(self.dtype_names) != n or len(self.shapes) != n:
            raise SwapRefused("transfer.names, dtype_names and shapes must be equally long (1.."
                                 f"{MAX_TENSORS})", "invalid_request")
        if len(set(self.names)) != n:
            raise SwapRefused("transfer.names repeats a tensor", "invalid_request")
        bad = sorted(set(self.dtype_names) - DTYPES)
        if bad:
            raise SwapRefused(f"transfer.dtype_names: unknown dtype {bad[0]!r}", "invalid_request")
        if any(d < 0 for s in self.shapes for d in s):
            raise SwapRefused("transfer.shapes: negative dimension", "invalid_request")

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
            raise SwapRefused("the transfer does not fit the served model "
                              f"({reference}): " + "; ".join(parts),
                            "weights_mismatch")

    def update_info(self) -> dict[str, Any]:
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}


class TransferFailed(SwapError):
    """A replica's part failed; ``touched``: it had started loading (its weights are mixed until reloaded)."""

    def __init__(self, message: str, touched: bool) -> None:
        super().__init__(message, "transfer_failed")
        self.touched = touched


def refuse_unsupported(clients: list[BackendClient]) -> None:
    """Refuse a transfer, before anything pauses, to replicas whose vLLM has no weight-transfer routes."""
    lacking = [c for c in clients if not c.caps.transfer]
    if lacking:
        names = ", ".join(c.name for c in lacking)
        raise SwapRefused(f"refusing a transfer: {names} serve no weight-transfer "
                          f"routes ({lacking[0].caps.why.get('transfer')}): publish through disk "
                          "(weight_sync = \"disk\")", "transfer_unsupported")


async def plan(clients: list[BackendClient]) -> tuple[dict[str, int], int]:
    """Each replica's first rank in the group (the learner is 0) and the group's size: ask each its world."""
    offsets, rank = {}, 1
    for client in clients:
        offsets[client.name], rank = rank, rank + max(1, await client.world_size())
    return offsets, rank


async def receive(client: BackendClient, spec: Transfer, rank_offset: int, world_size: int,
                  version: int) -> None:
    """One replica joins the group, receives every tensor and loads it; raises ``TransferFailed``."""
    init = {"master_address": spec.address, "master_port": spec.port, "secret": spec.secret,
            "rank_offset": rank_offset, "world_size": world_size, "backend": spec.backend,
            "timeout_s": spec.timeout_s}
    touched = False
    try:
        await client.init_transfer(init)
        await client.start_weight_update()
        touched = True
        await client.update_weights(spec.update_info())
        await client.finish_weight_update(str(version))
    except DomainError as exc:
        raise TransferFailed(f"weight transfer to {client.name} failed: {exc.message}", touched) from None
    finally:
        try:  # the group is one transfer's: a later one makes its own (an older vLLM has no route for it)
            if client.caps.transfer_shutdown:
                await client.shutdown_transfer()
        except DomainError as exc:
            logger.warning("could not release the transfer group on %s: %s", client.name, exc.message)


async def reload_from_disk(client: BackendClient, path: str | None) -> str | None:
    """Put the last weights on disk back into a replica a transfer left mixed; the error, or None."""
    if path is None:
        return f"{client.name} holds mixed weights and no weights on disk are known to reload"
    try:
        await client.reload_weights(path)
    except DomainError as exc:
        return f"{client.name} could not reload {path} after a failed transfer: {exc.message}"
    return None


def transfer_error(failed: dict[str, str], what_now: str) -> SwapError:
    return SwapError("; ".join(failed.values()) + f". {what_now}", "transfer_failed")
