"""The files ``steptap export`` writes, in either format: each written under a private temporary name and
renamed into place when complete, and the images the steps name, copied once."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from steptap.middleware.curation import CurationState
from steptap.middleware.files import FILE_MODE, atomic_write, makedirs
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


class TrajectoryFiles:
    """What both export formats' writers share: the settings (ratings given late, provenance, curation marks,
    the images folder), the counters ``steptap export``'s summary reads, and ``admit``, which decides whether
    a trajectory is written."""

    def __init__(self, *, late: dict[str, list[RewardAdded]] | None = None,
                 provenance: dict[str, str | None] | None = None,
                 curation: dict[str, CurationState] | None = None, keep_excluded: bool = False,
                 images_dir: str | Path | None = None, resolve: Callable[[str], bytes | None] | None = None,
                 ) -> None:
        self.late = late or {}
        self.provenance = provenance or {}
        self.curation = curation or {}
        self.keep_excluded = keep_excluded
        # each image the steps name, written once as IMAGES_DIR/<sha256> (``resolve``: the log's or proxy's)
        self.images_dir = makedirs(images_dir) if images_dir is not None else None
        self.resolve = resolve
        self.images = 0
        self.images_missing = 0  # named by a step, held by neither the log nor the proxy (compacted)
        self.trajectories = 0
        self.excluded_trajectories = 0  # left out: curation excluded them (kept with keep_excluded)
        self.excluded_steps = 0  # steps of the others left out (or kept) for the same reason

    def admit(self, traj: Trajectory) -> tuple[bool, CurationState | None]:
        """Whether ``traj`` is written (not if curation excluded it, unless ``keep_excluded``), and its
        curation marks; counted, and its images saved, when it is."""
        state = self.curation.get(traj.id)
        if state is not None and state.excluded:
            self.excluded_trajectories += 1
            if not self.keep_excluded:
                return False, state
        elif state is not None:
            self.excluded_steps += sum(s.index in state.excluded_steps for s in traj.steps)
        self.trajectories += 1
        if self.images_dir is not None and self.resolve is not None:
            written, missing = save_images(traj, self.images_dir, self.resolve)
            self.images, self.images_missing = self.images + written, self.images_missing + missing
        return True, state
