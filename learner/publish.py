"""Publishing the learner's weights to the proxy: write them to disk, then ``POST /admin/weights``.

Full weights are written as a Hugging Face model directory (safetensors, ``config.json``, tokenizer when
given); in LoRA mode the peft adapter is written (``save_pretrained``: ``adapter_config.json`` +
``adapter_model.safetensors``). Each publish goes into a fresh directory, written under a temporary name and
renamed into place, so vLLM never reads a half-written directory, and a LoRA adapter is never reloaded from a
path it already cached. Old directories are pruned to the last ``keep``.

One path publishes: ``publish_written`` swaps a written directory into every proxy under one version (the
daemon writes with its engine, then calls it; ``publish_weights`` writes a model in hand and calls it). It is
synchronous: the training loop waits for the swap, which is what makes the next batch's steps carry the new
version.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from steptap.middleware import files
from steptap.middleware.client import SteptapError, SyncSteptapClient

logger = logging.getLogger("steptap.learner.publish")

MARKER = ".steptap-weights"  # only directories holding this file are ever pruned


class PublishError(RuntimeError):
    """The proxy refused or failed the swap (its message says why); the proxy still serves the old version."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def write_weights(
    model: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    *,
    version: int | None = None,
    lora: bool = False,
) -> Path:
    """Write ``model`` (or its peft adapter, ``lora=True``) into a fresh directory under ``out_dir``."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper saves under prefixed names

    def save(tmp: Path) -> None:
        if lora:
            if not hasattr(model, "peft_config"):
                raise TypeError("lora=True needs a peft model (PeftModel) to save its adapter")
            model.save_pretrained(str(tmp))  # adapter_config.json + adapter_model.safetensors
        else:
            if hasattr(model, "peft_config"):
                raise TypeError("a peft model publishes its adapter: pass lora=True (or merge it first)")
            # Safetensors: the default since transformers 4.35, the only form in 5
            model.save_pretrained(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))

    return write_dir(out_dir, save, version=version, lora=lora)


def write_dir(
    out_dir: str | os.PathLike[str],
    save: Callable[[Path], None],
    *,
    version: int | None = None,
    lora: bool = False,
) -> Path:
    """A fresh directory under ``out_dir`` filled by ``save(tmp)``, renamed into place only once complete."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    base = f"v{version:06d}" if version is not None else f"w{time.time_ns()}"
    final = root / base
    n = 1
    while final.exists():  # a retried version: never reuse a path (vLLM caches adapters by path)
        final = root / f"{base}.{n}"
        n += 1
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save(tmp)
        (tmp / MARKER).write_text(json.dumps({"version": version, "lora": lora, "at": time.time()}))
        files.sync_tree(tmp)  # contents durable before the directory appears under its final name
        os.rename(tmp, final)  # atomic on one filesystem
        files.fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def request_swap(
    proxy_url: str,
    control_token: str,
    weights_dir: str | os.PathLike[str],
    *,
    lora: bool = False,
    version: int | None = None,
    timeout_s: float = 900.0,
) -> int:
    """``POST /admin/weights`` and return the proxy's new ``policy_version``."""
    where = str(Path(weights_dir).resolve())
    client = SyncSteptapClient(proxy_url, control_token)
    try:
        return client.swap_weights(path=None if lora else where, lora_path=where if lora else None,
                                   version=version, timeout_s=timeout_s)
    except SteptapError as exc:
        raise PublishError(f"weight swap refused ({exc.status}): {exc.message}", exc.status,
                           exc.code) from None
    except OSError as exc:  # refused connection, timeout: status None
        raise PublishError(f"proxy {proxy_url} unreachable for the weight swap: {exc}", None,
                           "proxy_unreachable") from None


def publish_written(
    path: Path,
    proxy_urls: list[str],
    control_token: str,
    out_dir: str | os.PathLike[str],
    *,
    version: int | None = None,
    lora: bool = False,
    keep: int = 3,
    timeout_s: float = 900.0,
) -> dict[str, int | PublishError]:
    """Swap the weights written at ``path`` (``write_weights``, or an engine's own writer) into every proxy's
    vLLM in parallel, under one version: the one way weights are published (the daemon's, and
    ``publish_weights``'s). Returns each proxy's new ``policy_version``, or the ``PublishError`` it answered.
    Once a proxy took them, older directories are pruned to ``keep``; refused by every proxy, the directory
    is removed (nothing refers to it; after a timeout or with a proxy unreachable it stays, since the swap
    may still have happened)."""
    t0 = time.monotonic()

    def swap(url: str) -> int | PublishError:
        try:
            return request_swap(url, control_token, path, lora=lora, version=version, timeout_s=timeout_s)
        except PublishError as exc:
            return exc

    with ThreadPoolExecutor(max(1, len(proxy_urls))) as pool:
        answers = dict(zip(proxy_urls, pool.map(swap, proxy_urls), strict=True))
    if any(isinstance(a, int) for a in answers.values()):
        logger.info("published %s as policy version %s (swap %.2f s)", path,
                    ", ".join(str(a) for a in answers.values() if isinstance(a, int)), time.monotonic() - t0)
        prune(out_dir, keep=keep, protect=path)
    elif all(isinstance(a, PublishError) and a.status is not None for a in answers.values()):
        shutil.rmtree(path, ignore_errors=True)
    return answers


def publish_weights(
    model: Any,
    tokenizer: Any,
    proxy_url: str,
    control_token: str,
    out_dir: str | os.PathLike[str],
    *,
    version: int | None = None,
    lora: bool = False,
    keep: int = 3,
    timeout_s: float = 900.0,
) -> int:
    """Write the weights (or the peft adapter with ``lora=True``) and publish them to one proxy
    (``publish_written``): for a script with a model in hand.

    Returns the new ``policy_version``. Raises ``PublishError`` when the proxy refuses or fails the swap (the
    directory just written is then removed: nothing refers to it) or cannot be reached (``status`` None; the
    directory is kept, since after a timeout the swap may still have happened). Training can go on either
    way: the proxy keeps serving its current version."""
    path = write_weights(model, tokenizer, out_dir, version=version, lora=lora)
    answer = publish_written(path, [proxy_url], control_token, out_dir, version=version, lora=lora, keep=keep,
                             timeout_s=timeout_s)[proxy_url]
    if isinstance(answer, PublishError):
        raise answer
    return answer


def prune(out_dir: str | os.PathLike[str], *, keep: int = 3, protect: Path | None = None) -> list[Path]:
    """Remove all but the newest ``keep`` published directories (never ``protect``, the live one)."""
    root = Path(out_dir)
    ours = sorted(
        (p for p in root.iterdir() if p.is_dir() and (p / MARKER).is_file()),
        key=lambda p: (p / MARKER).stat().st_mtime,
    )
    removed = []
    for p in ours[:-keep] if keep > 0 else ours:
        if protect is not None and p.resolve() == protect.resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed

