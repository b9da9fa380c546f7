"""``steptap export``: finished trajectories as parquet, one row per step, or as Harbor's RolloutDetail.

    steptap export --log runs/up-x/log --out data/steps            # a log directory or fsspec URL, no proxy
    steptap export --proxy http://127.0.0.1:8400 --out data/steps  # through a running proxy's stream
    steptap export --log runs/up-x/log --format rollout-detail --out data/harbor

The command: where trajectories come from and which format writes them. ``--format parquet`` (the default,
adapters/export_parquet.py) writes ``OUT/part-NNNNN.parquet``, one row per step; ``--format rollout-detail``
(adapters/rollout_detail.py) writes ``OUT/rollout_details.jsonl``, one trajectory a line in Harbor's shapes.
Either way curation (middleware/curation.py) is applied as the learner applies it, the marks coming from the
log (``--log``) or the proxy's lookup (``--proxy``), and nothing is acknowledged on the proxy's stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from steptap.adapters.export_parquet import PartWriter
from steptap.adapters.rollout_detail import FILE_NAME, RolloutWriter
from steptap.middleware.client import TOKEN_ENV, SteptapClient, SyncSteptapClient
from steptap.middleware.client.curation import lookup
from steptap.middleware.curation import fold
from steptap.middleware.model_files import provenance
from steptap.middleware.records import Trajectory

CONSUMER = "steptap-export"  # the stream consumer name; never acknowledged
LOOKUP_BATCH = 64  # trajectories held from the stream while their curation marks are asked for
LOOKUP_PATIENCE_S = 60.0  # a proxy that cannot answer a lookup (restarting) is asked again this long
FORMATS = ("parquet", "rollout-detail")


def make_writer(fmt: str, out: str | Path, **kw: Any) -> PartWriter | RolloutWriter:
    """The writer of ``fmt`` (``FORMATS``): parquet parts, or Harbor's shapes."""
    return RolloutWriter(out, **kw) if fmt == "rollout-detail" else PartWriter(out, **kw)


def existing_output(fmt: str, out: Path) -> list[Path]:
    """What an export of ``fmt`` into ``out`` would replace."""
    if not out.is_dir():
        return []
    if fmt == "rollout-detail":
        return [out / FILE_NAME] if (out / FILE_NAME).exists() else []
    return sorted(out.glob("part-*.parquet"))


def export_trajectories(trajs: Iterable[Trajectory], out: str | Path, fmt: str = "parquet",
                        **kw: Any) -> PartWriter | RolloutWriter:
    writer = make_writer(fmt, out, **kw)
    for traj in trajs:
        writer.add(traj)
    writer.close()
    return writer


async def proxy_trajectories(client: SteptapClient) -> AsyncIterator[Trajectory]:
    """The finished trajectories a proxy's stream holds now (from the start of its log; no ack)."""
    import aiohttp

    from steptap.middleware.client import SteptapError

    try:  # the stream reconnects forever on connection errors: check once that the proxy is there
        await client._request("GET", "/health")
    except SteptapError as exc:
        if exc.status != 503:  # 503: up, its backend degraded (the log is still readable)
            raise
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ConnectionError(f"cannot reach the steptap proxy at {client.url}: {exc}") from exc
    async for delivery in client.trajectories(CONSUMER, follow=False, cursor=None, dedup=True):
        yield delivery.trajectory


async def _export_proxy(url: str, token: str, out: str, mode: str | None, fmt: str,
                        **kw: Any) -> PartWriter | RolloutWriter:
    """Trajectories in batches of ``LOOKUP_BATCH``, each batch's curation marks asked of the proxy (the
    learner's lookup) before it is written."""
    from steptap.middleware.client import SteptapClient

    writer = make_writer(fmt, out, **kw)
    batch: list[Trajectory] = []
    async with SteptapClient(url, token, timeout_s=10) as client:

        async def write() -> None:
            deadline = time.monotonic() + LOOKUP_PATIENCE_S  # each batch's own
            marks = await lookup(client, [t.id for t in batch], lambda: time.monotonic() > deadline,
                                 lambda msg: print(re.sub(r"\[/?\w+\]", "", msg), file=sys.stderr))
            writer.curation = marks
            for traj in batch:
                await asyncio.to_thread(writer.add, traj)
            batch.clear()

        async for traj in proxy_trajectories(client):
            if mode is None or traj.mode == mode:
                batch.append(traj)
                if len(batch) >= LOOKUP_BATCH:
                    await write()
        await write()
    writer.close()
    return writer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steptap export", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--log", help="trajectory log directory or fsspec URL (read-only, no proxy needed)")
    src.add_argument(
        "--proxy",
        help="a running proxy's URL (its stream; the control token from "
        "--control-token or $STEPTAP_CONTROL_TOKEN)",
    )
    p.add_argument("--control-token", default=os.environ.get(TOKEN_ENV))
    p.add_argument("--out", required=True, help="output directory (part-NNNNN.parquet files, or "
                   "rollout_details.jsonl)")
    p.add_argument("--format", choices=FORMATS, default="parquet", help="parquet: one row per step; "
                   "rollout-detail: one line per trajectory in Harbor's shapes "
                   "(AgentContext.rollout_details, VerifierResult.rewards)")
    p.add_argument("--mode", choices=("train", "eval", "judge"), help="only trajectories of this mode")
    p.add_argument("--rows-per-file", type=int, default=100_000, help="rows per parquet part")
    p.add_argument("--model-dir", help="the model the run sampled from (HF directory): its weights, "
                   "tokenizer and chat template hashes go in every row (or line) and, for parquet, "
                   "OUT/_provenance.json")
    p.add_argument("--overwrite", action="store_true", help="replace the export files --out holds")
    p.add_argument("--images-dir", help="also write the bytes of each image a step names, once, as "
                   "IMAGES_DIR/<sha256> (the rows' images column and messages name them)")
    p.add_argument("--keep-excluded", action="store_true", help="keep the trajectories and steps curation "
                   "excluded (curation_excluded set) instead of leaving them out")
    return p


def main(argv: list[str] | None = None) -> int:
    """``steptap export``: finished trajectories -> parquet, one row per step (or Harbor's RolloutDetail)."""
    p = _parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from steptap.middleware.client import SteptapError

    out = Path(args.out)
    existing = existing_output(args.format, out)
    if existing and not args.overwrite:
        p.exit(2, f"steptap export: {out} already holds {len(existing)} export file(s); use --overwrite\n")
    if args.proxy and not args.control_token:
        p.error("--proxy needs the control token (--control-token or $STEPTAP_CONTROL_TOKEN)")
    for f in existing:
        f.unlink()
    try:
        prov = {} if args.model_dir is None else provenance(args.model_dir)
        per_format = {"rows_per_file": args.rows_per_file} if args.format == "parquet" else {}
        writer, skipped = (_from_log if args.log else _from_proxy)(args, out, prov, per_format)
    except (FileNotFoundError, ImportError, OSError, RuntimeError, SteptapError) as exc:
        p.exit(2, f"steptap export: {exc}\n")
    print(json.dumps(_summary(out, writer, args.keep_excluded, skipped)))
    return 0


def _from_log(args: argparse.Namespace, out: Path, prov: dict[str, Any],
              per_format: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """The writer of what a log holds, read offline, and what the read skipped."""
    from steptap.middleware.log.offline import LogReader

    reader = LogReader(args.log)
    notes = reader.annotations()
    writer = export_trajectories(
        reader.trajectories(mode=args.mode), out, args.format, **per_format,
        late=notes.late, provenance=prov, keep_excluded=args.keep_excluded,
        curation={tid: fold(marks) for tid, marks in notes.marks.items()},
        images_dir=args.images_dir, resolve=reader.image,
    )
    return writer, {"undecodable": reader.stats.undecodable, "corrupt_bytes": reader.stats.corrupt_bytes,
                    "marks_over": notes.marks_over}


def _from_proxy(args: argparse.Namespace, out: Path, prov: dict[str, Any],
                per_format: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """The writer of a running proxy's stream (nothing skipped: the proxy sends whole records)."""
    writer = asyncio.run(_export_proxy(
        args.proxy.rstrip("/"), args.control_token, str(out), args.mode, args.format, **per_format,
        provenance=prov, keep_excluded=args.keep_excluded, images_dir=args.images_dir,
        resolve=SyncSteptapClient(args.proxy.rstrip("/"), args.control_token).image,
    ))
    return writer, {}


def _summary(out: Path, writer: Any, kept_excluded: bool, skipped: dict[str, int]) -> dict[str, Any]:
    return {
        "out": str(out),
        "trajectories": writer.trajectories,
        "rows": writer.rows,
        "files": [f.name for f in writer.files],
        "bad_rows": writer.bad_rows,
        "late_rewards": sum(len(v) for v in writer.late.values()),
        "excluded_trajectories": writer.excluded_trajectories,
        "excluded_steps": writer.excluded_steps,
        "kept_excluded": kept_excluded,
        "images": writer.images,
        "images_missing": writer.images_missing,
        # a failed step is a parquet row (status "failed"), never a RolloutDetail turn
        **({} if isinstance(writer, PartWriter) else {"failed_steps": writer.failed_steps}),
        **skipped,
    }


if __name__ == "__main__":
    sys.exit(main())
