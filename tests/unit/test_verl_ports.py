"""The verl workers' TCPStore port: a window below the ephemeral range, where no outgoing connection can be
given it between verl's check and the store's bind (the EADDRINUSE once seen beside parallel tests)."""

from __future__ import annotations

from pathlib import Path

from steptap.learner.engines.verl_engine import master_port_range


def test_the_master_port_window_lies_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    windows = {tuple(master_port_range() or ()) for _ in range(20)}
    for start, end in windows:
        assert 1024 < start < end <= low and end - start == 256
    assert len(windows) > 1  # random: learners started together rarely scan from one port
