"""Images in model calls: each image part of the chat body sent upstream (the three protocols' images arrive
there as chat ``image_url`` parts: messages_request.py, responses_request.py) read, checked and hashed before
anything is forwarded or recorded.

A data URL is decoded; an http(s) URL is fetched by the proxy itself (only from the hosts ``--image-urls``
allows, bounded in size and time, no redirects) and sent upstream as a data URL, so vLLM, the record and the
image store see the same bytes. Each image is decoded with Pillow (an undecodable one, or one past
``max_image_bytes`` / ``max_image_pixels`` / ``max_images_per_call``, is a 400 and nothing is recorded). The
logged request holds a reference in place of each image's data (``with_refs``; log/images.py stores the bytes
once by digest).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import ApiError
from steptap.middleware.exceptions import Overloaded
from steptap.middleware.proxy.translation import data_url
from steptap.middleware.records import ImageRef, image_digest, ref_of
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.session import Images, LiveSession


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_image")


@dataclass(frozen=True)
class Image:
    """One image of a call, as the model receives it."""

    sha256: str
    data: bytes
    mime: str
    width: int
    height: int

    def ref(self) -> ImageRef:
        return ImageRef(sha256=self.sha256, mime=self.mime, width=self.width, height=self.height,
                        size=len(self.data))

    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode()}"


def _source(part: dict[str, Any]) -> Any:
    spec = part.get("image_url")
    return spec.get("url") if isinstance(spec, dict) else spec


def image_parts(chat: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The chat body's ``image_url`` parts, in prompt order."""
    for msg in chat.get("messages") or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield part


def has_images(chat: dict[str, Any]) -> bool:
    return next(image_parts(chat), None) is not None


async def gather(chat: dict[str, Any], cfg: ProxyConfig, known: dict[str, Image]) -> list[Image]:
    """Each image of the chat body, in prompt order; ``known`` (source -> image) spares a source met before
    in this call its second decode or fetch."""
    out: list[Image] = []
    for part in image_parts(chat):
        src = _source(part)
        if not isinstance(src, str) or not src:
            raise _bad("an image_url part needs a string url")
        if len(out) >= cfg.max_images_per_call:
            raise _bad(f"the call carries more than {cfg.max_images_per_call} images (max_images_per_call)")
        if src not in known:
            raw = await _fetch(src, cfg) if src.startswith(("http://", "https://")) else _decode_data_url(src,
                                                                                                         cfg)
            known[src] = await asyncio.to_thread(inspect, raw, cfg)
        out.append(known[src])
    return out


def _decode_data_url(src: str, cfg: ProxyConfig) -> bytes:
    head, sep, payload = src.partition(",")
    if not head.startswith("data:") or not sep or not head.endswith(";base64"):
        raise _bad("an image must be a base64 data URL (data:image/png;base64,...) or an http(s) URL, not "
                   f"{src[:40]!r}")
    if len(payload) * 3 // 4 > cfg.max_image_bytes + 3:
        raise _bad(f"an image is larger than {cfg.max_image_bytes} bytes (max_image_bytes)")
    try:
        return binascii.a2b_base64(payload, strict_mode=False)
    except (binascii.Error, ValueError):
        raise _bad("an image's data URL is not valid base64") from None


def inspect(raw: bytes, cfg: ProxyConfig) -> Image:
    """The image's digest, type and size, once Pillow decoded it whole (a thread: decoding takes time)."""
    from PIL import Image as Pil  # noqa: N813 - only when a call carries an image
    from PIL import UnidentifiedImageError

    if len(raw) > cfg.max_image_bytes:
        raise _bad(f"an image is larger than {cfg.max_image_bytes} bytes (max_image_bytes)")
    try:
        with Pil.open(io.BytesIO(raw)) as img:
            width, height = img.size
            if width * height > cfg.max_image_pixels:  # from the header, before decoding
                raise _bad(f"an image of {width}x{height} pixels is past max_image_pixels "
                           f"({cfg.max_image_pixels})")
            img.load()
            mime = Pil.MIME.get(img.format or "", "application/octet-stream")
    except ApiError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Pil.DecompressionBombError) as exc:
        raise _bad(f"an image could not be decoded: {exc}") from None
    return Image(sha256=image_digest(raw), data=raw, mime=mime, width=width, height=height)


def _host_allowed(url: str, cfg: ProxyConfig) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return "*" in cfg.image_urls or host in {h.lower() for h in cfg.image_urls}


async def _fetch(url: str, cfg: ProxyConfig) -> bytes:
    """An image URL's bytes: allowed hosts only, no redirects, at most ``max_image_bytes``, within
    ``image_url_timeout_s``."""
    if not _host_allowed(url, cfg):
        raise _bad(f"image URLs from {urlsplit(url).hostname!r} are not fetched: allow the host with "
                   "--image-urls HOST (or '*'), or send the image as a base64 data URL")
    timeout = aiohttp.ClientTimeout(total=cfg.image_url_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http, \
                http.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise _bad(f"fetching the image {url[:200]} answered {resp.status}")
            if (resp.content_length or 0) > cfg.max_image_bytes:
                raise _bad(f"the image at {url[:200]} is larger than {cfg.max_image_bytes} bytes "
                           "(max_image_bytes)")
            data = await resp.content.read(cfg.max_image_bytes + 1)
            if len(data) > cfg.max_image_bytes or not resp.content.at_eof():
                raise _bad(f"the image at {url[:200]} is larger than {cfg.max_image_bytes} bytes "
                           "(max_image_bytes)")
            return data
    except TimeoutError:
        raise _bad(f"fetching the image {url[:200]} took longer than {cfg.image_url_timeout_s} s "
                   "(image_url_timeout_s)") from None
    except aiohttp.ClientError as exc:
        raise _bad(f"fetching the image {url[:200]} failed: {exc}") from None


def with_data(chat: dict[str, Any], known: dict[str, Image]) -> dict[str, Any]:
    """The chat body with each fetched URL image as the data URL of its bytes (the same object when no part
    changes)."""
    if not any(isinstance(s, str) and s.startswith(("http://", "https://")) for s in map(_source,
                                                                                           image_parts(chat))):
        return chat

    def part(p: dict[str, Any]) -> dict[str, Any]:
        src = _source(p)
        if p.get("type") != "image_url" or src not in known or not src.startswith(("http://", "https://")):
            return p
        spec = p["image_url"]
        return {**p, "image_url": {**spec, "url": known[src].data_url()} if isinstance(spec, dict)
                else known[src].data_url()}

    messages = [{**m, "content": [part(p) if isinstance(p, dict) else p for p in m["content"]]}
                if isinstance(m, dict) and isinstance(m.get("content"), list) else m
                for m in chat["messages"]]
    return {**chat, "messages": messages}


def with_refs(body: Any, known: dict[str, Image]) -> Any:
    """The agent's body (chat, Responses or Messages) with each image's data or URL replaced by its
    reference (``ref_of``), copied only where it changes: what the log holds."""
    if isinstance(body, list):
        out = [with_refs(v, known) for v in body]
        return body if all(a is b for a, b in zip(out, body, strict=True)) else out
    if not isinstance(body, dict):
        return body
    kind = body.get("type")
    if kind == "image_url":  # chat
        src = _source(body)
        if src in known:
            spec = body["image_url"]
            ref = _ref(known[src])
            return {**body, "image_url": {**spec, "url": ref} if isinstance(spec, dict) else ref}
    elif kind == "input_image":  # Responses
        src = body.get("image_url")
        if src in known:
            return {**body, "image_url": _ref(known[src])}
    elif kind == "image" and isinstance(body.get("source"), dict):  # Messages
        source = body["source"]
        src = (data_url(source.get("media_type"), source.get("data")) if source.get("type") == "base64"
               else source.get("url"))
        if src in known:
            ref = _ref(known[src])
            return {**body, "source": {**source, "data": ref} if source.get("type") == "base64"
                    else {**source, "url": ref}}
    changed = {k: with_refs(v, known) for k, v in body.items() if isinstance(v, (dict, list))}
    changed = {k: v for k, v in changed.items() if v is not body[k]}
    return {**body, **changed} if changed else body


def strip_images(body: Any) -> Any:
    """A refused call's body as its failed step keeps it: each image's data dropped (never stored)."""
    known: dict[str, Image] = {}
    for src in _all_sources(body):
        known[src] = _OMITTED
    return with_refs(body, known) if known else body


_OMITTED = Image(sha256="", data=b"", mime="", width=0, height=0)  # a refused call's images
OMITTED = "steptap-image:omitted"  # what a refused call's failed step holds in place of an image


def _ref(image: Image) -> str:
    return OMITTED if image is _OMITTED else ref_of(image.sha256)


def _all_sources(body: Any) -> Iterator[str]:
    if isinstance(body, list):
        for v in body:
            yield from _all_sources(v)
    elif isinstance(body, dict):
        kind = body.get("type")
        src: Any = None
        if kind == "image_url":
            src = _source(body)
        elif kind == "input_image":
            src = body.get("image_url")
        elif kind == "image" and isinstance(body.get("source"), dict):
            s = body["source"]
            src = data_url(s.get("media_type"), s.get("data")) if s.get("type") == "base64" else s.get("url")
        if isinstance(src, str):
            yield src
        for v in body.values():
            if isinstance(v, (dict, list)):
                yield from _all_sources(v)


class ImageMemory:
    """The decoded image bytes the calls in flight hold, against ``max_image_memory`` (429 beyond)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @contextlib.contextmanager
    def hold(self, size: int) -> Iterator[None]:
        if size and self.held + size > self.limit:
            raise Overloaded(f"images in flight would take more than {self.limit} bytes (max_image_memory): "
                             "retry later")
        self.held += size
        try:
            yield
        finally:
            self.held -= size


IMAGE_MEMORY_KEY = web.AppKey("steptap_image_memory", ImageMemory)


class CallImages:
    """One call's images while it is in flight (an async context manager): read from the chat body on
    entry, their bytes counted against ``max_image_memory`` and held from compaction until the call's steps
    name them, stored before anything is forwarded."""

    def __init__(self, cfg: ProxyConfig | None, memory: ImageMemory | None, store: Images | None,
                 chat: dict[str, Any] | None = None) -> None:
        self.cfg, self.memory, self.store, self.chat = cfg, memory, store, chat
        self.known: dict[str, Image] = {}  # source (data URL or URL) -> image
        self.images: list[Image] = []  # the prompt's, in prompt order
        self._stack = contextlib.ExitStack()

    async def __aenter__(self) -> CallImages:
        if self.chat is not None:
            try:
                await self.read(self.chat)
            except BaseException:
                self._stack.close()  # __aexit__ will not run
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stack.close()

    async def read(self, chat: dict[str, Any]) -> None:
        """The chat body's images (all of them: a stored conversation's too); the new ones held and stored."""
        if not has_images(chat):
            return
        assert self.cfg is not None and self.memory is not None and self.store is not None
        before = set(self.known)
        self.images = await gather(chat, self.cfg, self.known)
        new = [image for src, image in self.known.items() if src not in before]
        if new:
            self._stack.enter_context(self.memory.hold(sum(len(i.data) for i in new)))
            self._stack.enter_context(self.store.hold([i.sha256 for i in new]))
            await self.store.put((i.sha256, i.data) for i in new)

    async def again(self, chat: dict[str, Any], manager: SessionManager, session: LiveSession) -> None:
        """After a stored conversation was joined (``previous_response_id``): too many images together is a
        400 like any other, and an auto session the call would have opened is dropped."""
        try:
            await self.read(chat)
        except ApiError:
            if session.pending and session.inflight == 0:
                manager.pending.pop(session.id, None)
            raise

    def refs(self) -> list[ImageRef]:
        return [i.ref() for i in self.images]

    def logged(self, body: Any) -> Any:
        return with_refs(body, self.known) if self.known else body

    def upstream(self, proto: Any, body: dict[str, Any]) -> dict[str, Any]:
        """The chat body sent upstream, fetched images as data URLs; a protocol keeps it so (a stored
        Responses conversation replays the bytes, never fetches again)."""
        chat = proto.chat if proto is not None else body
        if self.known:
            chat = with_data(chat, self.known)
            if proto is not None:
                proto.chat = chat
            for src, image in list(self.known.items()):  # what upstream holds reads as references too
                if src.startswith(("http://", "https://")):
                    self.known[image.data_url()] = image
        return chat

    def tito(self, session: LiveSession, wanted: bool) -> bool:
        """Token-in-token-out for this call: not with images (vLLM renders those itself); what a later turn
        would extend is then forgotten."""
        if wanted and self.images:
            session.tito_state = None
            return False
        return wanted


NO_IMAGES = CallImages(None, None, None)  # a call without images (what _Call starts with)
