"""Publishing the learner's weights to the proxy: write them to disk, then ``POST /admin/weights``.

Full weights are written as a Hugging Face model directory (safetensors, ``config.json``, tokenizer when
given); in LoRA mode the peft adapter is written (``save_pretrained``: ``adapter_config.json`` +
``adapter_model.safetensors``). Each publish goes into a fresh directory, written under a temporary name and
renamed into place, so vLLM never reads a half-written directory, and a LoRA adapter is never reloaded from a
path it already cached. Old directories are pruned to the last ``keep``.

The daemon calls ``publish_weights`` as is; it is synchronous (the training loop waits for the swap, which
is what makes the next batch's steps carry the new version).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("steptap.learner.publish")

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
            model.save_pretrained(str(tmp))  # safetensors: the default since transformers 4.35, the only form in 5
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
        _fsync_dir(tmp)
        os.rename(tmp, final)  # atomic on one filesystem
        _fsync_dir(root)
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
    body: dict[str, Any] = {("lora_path" if lora else "path"): str(Path(weights_dir).resolve())}
    if version is not None:
        body["version"] = int(version)
    req = urllib.request.Request(
        proxy_url.rstrip("/") + "/admin/weights",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {control_token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return int(json.loads(resp.read())["version"])
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            err = json.loads(raw)["error"]
            message, code = err.get("message", ""), err.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = raw.decode(errors="replace")[:500], None
        raise PublishError(f"weight swap refused ({exc.code}): {message}", exc.code, code) from None
    except (urllib.error.URLError, OSError) as exc:  # refused connection, timeout: status None
        reason = getattr(exc, "reason", exc)
        raise PublishError(f"proxy {proxy_url} unreachable for the weight swap: {reason}", None,
                           "proxy_unreachable") from None


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
    """Write the weights (or the peft adapter with ``lora=True``) and swap them into the proxy's vLLM.

    Returns the new ``policy_version``. Raises ``PublishError`` when the proxy refuses or fails the swap (the
    directory just written is then removed: nothing refers to it) or cannot be reached (``status`` None; the
    directory is kept, since after a timeout the swap may still have happened). Training can go on either
    way: the proxy keeps serving its current version."""
    t0 = time.monotonic()
    path = write_weights(model, tokenizer, out_dir, version=version, lora=lora)
    return swap_written(path, proxy_url, control_token, out_dir, version=version, lora=lora, keep=keep,
                        timeout_s=timeout_s, written_s=time.monotonic() - t0)


def swap_written(
    path: Path,
    proxy_url: str,
    control_token: str,
    out_dir: str | os.PathLike[str],
    *,
    version: int | None = None,
    lora: bool = False,
    keep: int = 3,
    timeout_s: float = 900.0,
    written_s: float = 0.0,
) -> int:
    """Swap a directory ``write_weights`` (or an engine's ``write_weights``) wrote into the proxy's vLLM: the
    second half of ``publish_weights``, for engines that write their weights themselves."""
    t0 = time.monotonic()
    try:
        new_version = request_swap(
            proxy_url, control_token, path, lora=lora, version=version, timeout_s=timeout_s
        )
    except PublishError as exc:
        if exc.status is not None:
            shutil.rmtree(path, ignore_errors=True)
        raise
    log.info(
        "published %s as policy version %d (write %.2f s, swap %.2f s)",
        path,
        new_version,
        written_s,
        time.monotonic() - t0,
    )
    prune(out_dir, keep=keep, protect=path)
    return new_version


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


def _fsync_dir(path: Path) -> None:
    for f in [*path.iterdir(), path] if path.is_dir() else [path]:
        if f.is_file() or f == path:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
