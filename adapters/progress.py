"""A progress bar for runs of many episodes (``steptap env run``, ``steptap eval``, ``steptap tasks run``): a
tqdm bar on stderr when tqdm is installed, else a line every 16 episodes, with the mean of recent rewards."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.count = total, 0
        self.rewards: list[float] = []
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=total, desc=desc, unit="ep", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def update(self, reward: float | None, **extra: str) -> None:
        """One episode done, with its reward (None: none) and any other figures to show beside it."""
        self.count += 1
        if reward is not None:
            self.rewards.append(reward)
        del self.rewards[:-64]
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{mean:.3f}", **extra, refresh=False)
            self.bar.update(1)
        elif self.count % 16 == 0 or self.count == self.total:
            more = "".join(f", {k} {v}" for k, v in extra.items())
            print(f"{self.count}/{self.total} episodes, mean reward {mean:.3f}{more}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
