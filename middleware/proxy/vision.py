"""Images in model calls: each image part of the chat body sent upstream (the three protocols' images arrive
there as chat ``image_url`` parts: messages_request.py, responses_request.py) read, checked and hashed once
the call is admitted and routed (a refused call decodes nothing).

A data URL is decoded; an http(s) URL is fetched by the proxy itself (image_urls.py: allowed hosts and
addresses only, bounded, no redirects) and sent upstream as a data URL, so vLLM, the record and the image
store see the same bytes. Each image's header is read first: its decoded size (width x height x the bytes a
pixel takes) is checked against ``max_image_pixels`` and, with the call's other images, against
``max_image_memory`` (a 400) before Pillow decodes it, on a small executor of its own (``ImageMemory``), its
pixels held against ``max_image_memory`` while they are decoded and its bytes while the call is in flight (a
429 beyond). The logged request holds a reference in place of each image's data (``with_refs``); the bytes are
stored once by digest (log/images.py) only with the step that names them (``CallImages.stored``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import io
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import ApiError
from steptap.middleware.exceptions import Overloaded
from steptap.middleware.proxy import image_urls
from steptap.middleware.proxy.translation import data_url
from steptap.middleware.records import ImageRef, image_digest, ref_of
from steptap.middleware.sessions.limits import RETRY_AFTER_S
from steptap.middleware.sessions.session import Images

if TYPE_CHECKING:
    from steptap.middleware.proxy.call_state import CallState


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
    decoded: int = 0  # the bytes its pixels took once decoded

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


async def gather(chat: dict[str, Any], cfg: ProxyConfig, known: dict[str, Image], memory: ImageMemory,
                 holds: contextlib.ExitStack) -> list[Image]:
    """Each image of the chat body, in prompt order; ``known`` (source -> image) spares a source met before
    in this call its second decode or fetch. Each new image's bytes are held in ``memory`` on ``holds`` (until
    the call ends) as soon as they are read, then it is decoded on ``memory``'s executor."""
    out: list[Image] = []
    decoded = sum(i.decoded for i in known.values())  # the call's pixels decoded so far
    for part in image_parts(chat):
        src = _source(part)
        if not isinstance(src, str) or not src:
            raise _bad("an image_url part needs a string url")
        if len(out) >= cfg.max_images_per_call:
            raise _bad(f"the call carries more than {cfg.max_images_per_call} images (max_images_per_call)")
        if src not in known:
            hold = holds.enter_context(memory.hold(0))
            if src.startswith(("http://", "https://")):
                raw = await image_urls.fetch(src, cfg, hold.resize)
            else:
                raw = _decode_data_url(src, cfg)
                hold.resize(len(raw))
            known[src] = await memory.decode(raw, cfg, decoded)
            decoded += known[src].decoded
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


def pixel_bytes(mode: str) -> int:
    """The bytes Pillow keeps a pixel of this mode in once decoded: 1 (1, L, P), 2 (I;16), else 4 (RGB is
    kept in four)."""
    return 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4


def inspect(raw: bytes, cfg: ProxyConfig, memory: ImageMemory | None = None, before: int = 0) -> Image:
    """The image's digest, type and size, once Pillow decoded it whole (an image thread: decoding takes
    time). Its decoded size is read from the header and checked before decoding: past ``max_image_pixels``,
    or past ``max_image_memory`` with the ``before`` bytes the call's other images decode to, a 400; its
    pixels are held in ``memory`` while decoded (a 429 when they do not fit now)."""
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
            size = width * height * pixel_bytes(img.mode)
            if before + size > cfg.max_image_memory:
                raise _bad(f"the call's images decode to more than {cfg.max_image_memory} bytes "
                           f"(max_image_memory): {width}x{height} {img.mode} takes {size}")
            with memory.hold(size) if memory is not None else contextlib.nullcontext():
                img.load()
                mime = Pil.MIME.get(img.format or "", "application/octet-stream")
                img.close()  # the pixels given back before their hold is
    except ApiError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Pil.DecompressionBombError) as exc:
        raise _bad(f"an image could not be decoded: {exc}") from None
    if memory is not None:
        memory.count_decoded()
    return Image(sha256=image_digest(raw), data=raw, mime=mime, width=width, height=height, decoded=size)


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


IMAGE_DECODERS = 2  # threads that decode images: at most this many images' pixels in memory at once


class ImageMemory:
    """What the images of the calls in flight take, against ``max_image_memory`` (429 beyond): each image's
    bytes while its call is in flight, and its pixels while they are decoded; and the small executor that
    decodes them (never the loop's default one: the log stream and reward callbacks wait on that)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.decoded = 0  # images decoded (a count, for /metrics readers and tests)
        self._lock = threading.Lock()  # the decoders hold pixels from their threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def hold(self, size: int) -> Hold:
        """``size`` bytes held until the ``Hold`` (a context manager) ends; ``Hold.resize`` changes it."""
        hold = Hold(self)
        hold.resize(size)
        return hold

    def _change(self, by: int) -> None:
        with self._lock:
            if by > 0 and self.held + by > self.limit:
                raise Overloaded(f"images in flight would take more than {self.limit} bytes "
                                 "(max_image_memory): retry later", retry_after_s=RETRY_AFTER_S)
            self.held += by

    def count_decoded(self) -> None:
        with self._lock:
            self.decoded += 1

    async def decode(self, raw: bytes, cfg: ProxyConfig, before: int) -> Image:
        """``inspect`` on an image thread."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(IMAGE_DECODERS,
                                                                   thread_name_prefix="steptap-image")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, inspect, raw, cfg, self, before)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class Hold:
    """Bytes held in an ``ImageMemory`` (a context manager: given back when it ends)."""

    def __init__(self, memory: ImageMemory) -> None:
        self.memory = memory
        self.size = 0

    def resize(self, size: int) -> None:
        self.memory._change(size - self.size)
        self.size = size

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.memory._change(-self.size)
        self.size = 0


IMAGE_MEMORY_KEY = web.AppKey("steptap_image_memory", ImageMemory)


class CallImages:
    """One call's images while it is in flight (an async context manager): read from the chat body once the
    call is admitted (``read``), their bytes counted against ``max_image_memory`` until the call ends, stored
    only with the step that names them (``stored``; never with a ``store`` of None: count_tokens)."""

    def __init__(self, cfg: ProxyConfig | None, memory: ImageMemory | None, store: Images | None) -> None:
        self.cfg, self.memory, self.store = cfg, memory, store
        self.known: dict[str, Image] = {}  # source (data URL or URL) -> image
        self.images: list[Image] = []  # the prompt's, in prompt order
        self._holds: contextlib.ExitStack | None = None  # made for a call with images (most have none)

    async def __aenter__(self) -> CallImages:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._holds is not None:
            self._holds.close()

    async def read(self, chat: dict[str, Any]) -> None:
        """The chat body's images (all of them: a stored conversation's too); the new ones read and held."""
        if not has_images(chat):
            return
        assert self.cfg is not None and self.memory is not None
        if self._holds is None:
            self._holds = contextlib.ExitStack()
        self.images = await gather(chat, self.cfg, self.known, self.memory, self._holds)

    def stored(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Around the append of a step that names these images: each stored first (once by digest), and kept
        from compaction until the step is in the log (a call without images: nothing, at no cost)."""
        return _NOTHING if not self.images or self.store is None else self._stored()

    @contextlib.asynccontextmanager
    async def _stored(self) -> AsyncIterator[None]:
        assert self.store is not None
        with self.store.hold([i.sha256 for i in self.images]):
            await self.store.put((i.sha256, i.data) for i in self.images)
            yield

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

    def tito(self, state: CallState, wanted: bool) -> bool:
        """Token-in-token-out for this call: not with images (vLLM renders those itself); what a later turn
        would extend is then forgotten."""
        if wanted and self.images:
            state.tito_state = None
            return False
        return wanted


NO_IMAGES = CallImages(None, None, None)  # a call without images (what _Call starts with)
_NOTHING = contextlib.nullcontext()
