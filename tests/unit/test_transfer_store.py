"""The learner's side of a collective transfer against strangers (issue 25, item 1): its store listens only on
the address it is given, a process without the transfer's secret can neither join the group (and receive the
weights) nor crash the learner by writing to the store, and every failure ends as a ``PublishError``.

Real torch.distributed stores, real sockets; the proxy is a stand-in (tests/faults.py's ``TransferProxy``)
that holds the swap while the stranger acts and then fails it, the one part a real proxy cannot be made to do
without vLLM (the transfer with vLLM: tests/integration/test_weight_transfer.py)."""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from conftest import missing  # noqa: E402
from faults import TransferProxy  # noqa: E402

from steptap.learner.publish import PublishError  # noqa: E402
from steptap.learner.transfer import send_collective  # noqa: E402

OLD_PREFIX = "steptap-transfer/"  # the key names a stranger reads off the plugin's source
TD = datetime.timedelta(seconds=5)


def non_loopback() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def run_learner(proxy: TransferProxy, out: dict[str, Any]) -> threading.Thread:
    def go() -> None:
        try:
            out["version"] = send_collective([("w", torch.arange(4.0))], proxy.url, "tok",
                                             address="127.0.0.1",
                                             timeout_s=5, swap_timeout_s=30)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            out["error"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_the_store_listens_only_on_the_address_it_was_given() -> None:
    ip = non_loopback()
    if ip is None:
        missing("this host has no non-loopback address to try")  # a failure under CI, never a silent skip
    with TransferProxy() as proxy:
        out: dict[str, Any] = {}
        t = run_learner(proxy, out)
        body = proxy.body(timeout_s=20)
        port = body["transfer"]["port"]
        with pytest.raises(OSError):
            socket.create_connection((ip, port), timeout=2).close()
        proxy.answer_error()
        t.join(30)
    assert isinstance(out.get("error"), PublishError), repr(out)


def test_a_stranger_on_the_store_cannot_join_the_group() -> None:
    with TransferProxy() as proxy:
        out: dict[str, Any] = {}
        t = run_learner(proxy, out)
        transfer = proxy.body(timeout_s=20)["transfer"]
        assert len(transfer.get("secret", "")) >= 32  # handed over only in the authenticated body
        # A stranger who found the port joins as rank 1 of 2 under the names in the plugin's source.
        store = dist.TCPStore("127.0.0.1", transfer["port"], is_master=False, timeout=TD)
        dist.PrefixStore(OLD_PREFIX, store).set("world_size", "2")
        got = torch.zeros(4)
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(OLD_PREFIX, store), 1, 2, TD)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            group.broadcast([got], opts).wait()
        except RuntimeError:
            pass  # no peer answered: what should happen
        assert got.tolist() == [0.0, 0.0, 0.0, 0.0], "a stranger received the weights"
        proxy.answer_error()
        t.join(30)
    assert isinstance(out.get("error"), PublishError), repr(out)


def test_a_stranger_writing_nonsense_to_the_store_does_not_crash_the_learner() -> None:
    with TransferProxy() as proxy:
        out: dict[str, Any] = {}
        t = run_learner(proxy, out)
        transfer = proxy.body(timeout_s=20)["transfer"]
        store = dist.TCPStore("127.0.0.1", transfer["port"], is_master=False, timeout=TD)
        dist.PrefixStore(OLD_PREFIX, store).set("world_size", "not a number")  # the name in the source
        for key in store.list_keys():  # and every name it can see
            store.set(key, "not a number")
        t.join(3)  # the learner must not die of it (it waits on, bounded by the proxy's answer)
        assert "error" not in out, out
        proxy.answer_error()
        t.join(30)
    assert not t.is_alive()
    assert isinstance(out.get("error"), PublishError), repr(out)
