"""The files ``steptap export`` writes, in either format: each written under a private temporary name and
renamed into place when complete, and the images the steps name, copied once."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from steptap.middleware.files import FILE_MODE, atomic_write
from steptap.middleware.records import RewardAdded, Trajectory


def private_temp(final: Path) -> tuple[Path, BinaryIO]:
    """A new file beside ``final`` (renamed to it when complete) and its temporary name: 0600 whatever the
    umask, created here or not at all (never through a planted name)."""
    tmp = final.with_name(f".{final.name}.tmp-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return tmp, os.fdopen(fd, "wb")


def save_images(traj: Trajectory, images_dir: Path,
                resolve: Callable[[str], bytes | None]) -> tuple[int, int]:
    """Each image ``traj``'s steps name, written once as ``images_dir/<sha256>`` from ``resolve`` (the log's
    or the proxy's): how many were written, and how many neither held (compacted)."""
    written = missing = 0
    for sha in dict.fromkeys(i.sha256 for s in traj.steps for i in s.images):
        path = images_dir / sha
        if path.exists():
            continue
        data = resolve(sha)
        if data is None:
            missing += 1
            continue
        atomic_write(path, data, durable=False)
        written += 1
    return written, missing


def late_rewards(late: list[RewardAdded] | None) -> list[dict[str, object]]:
    """The ratings given after a trajectory was streamed, as both formats write them."""
    return [{"name": r.name, "value": r.value, "step": r.step, "source": r.source, "at": r.at,
             **({"provenance": r.provenance} if r.provenance else {})} for r in late or ()]
