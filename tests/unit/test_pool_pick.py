"""The replica pool's pick (backend/pool.py): a session's own replica while it is up, else the healthy one
with the fewest calls in flight (then the fewest calls, then the first configured); ``avoid`` skipped; none
healthy is a clear error naming each replica's state. Pure routing: the replicas' clients are never called,
so each is a named stand-in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from steptap.middleware.backend.pool import Replica, ReplicaPool
from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import BackendUnavailable, BackendUnreachable


def _pool(*names: str) -> ReplicaPool:
    pool = ReplicaPool(ProxyConfig())
    for name in names:
        rep = pool.replicas[name] = Replica(SimpleNamespace(name=name))  # type: ignore[arg-type]
        rep.up, rep.reason = True, None
    return pool


def test_the_least_loaded_healthy_replica_then_the_fewest_calls_then_the_first() -> None:
    pool = _pool("a", "b", "c")
    assert pool.pick().name == "a"  # all equal: the first configured
    pool.acquire(pool.replicas["a"])
    assert pool.pick().name == "b"
    pool.acquire(pool.replicas["b"])
    pool.release(pool.replicas["b"])  # b: none in flight, one call; c: none at all
    assert pool.pick().name == "c"
    pool.replicas["c"].up = False
    assert pool.pick().name == "b" and pool.pick(avoid="b").name == "a"


def test_a_session_sticks_to_its_replica_while_it_is_up_then_moves_once() -> None:
    pool = _pool("a", "b")
    assert pool.pick("s1").name == "a"
    pool.acquire(pool.replicas["a"])
    assert pool.pick("s1").name == "a" and pool.pick("s2").name == "b"  # sticky, however loaded
    pool.replicas["a"].up = False
    assert pool.pick("s1").name == "b" and pool.moves == 1
    pool.replicas["a"].up = True
    assert pool.pick("s1").name == "b"  # it moved: it stays on its new replica


def test_none_healthy_names_each_replica_and_unreachable_ones_say_so() -> None:
    pool = _pool("a", "b")
    pool.replicas["a"].up, pool.replicas["a"].reason = False, "paused"
    with pytest.raises(BackendUnavailable, match="no healthy backend replica"):
        pool.pick(avoid="b")
    for rep in pool.replicas.values():
        rep.up, rep.unreachable, rep.reason = False, True, "connection refused"
    with pytest.raises(BackendUnreachable, match=r"a: connection refused; b: connection refused"):
        pool.pick()
