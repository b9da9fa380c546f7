"""An http(s) image URL in a model call, fetched by the proxy itself (docs/SECURITY.md, "Image URLs").

The proxy reaches that address from where it runs, so a URL is fetched only when ``--image-urls`` allows its
host by name (``'*'``: any name), and only from an address that is public or that ``--image-urls`` lists as
an IP or a network: a name that resolves to loopback, a private, link-local or metadata address is refused.
The name is resolved once, and the connection goes to the address checked (a second lookup could answer
another: DNS rebinding). No redirect is followed; the body is read up to ``max_image_bytes`` (+1, to tell a
larger one), within ``image_url_timeout_s``. Every failure of a fetch is the same 400 text, so the answers
tell nothing of what listens where (the operator's log has the reason).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import ApiError

logger = logging.getLogger("steptap.images")

FETCH_FAILED = ("an image URL could not be fetched: it must answer 200 (no redirect) within "
                "image_url_timeout_s with at most max_image_bytes, from a public address or one --image-urls "
                "lists")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_image")


class _Refused(Exception):
    """Why a fetch failed, for the operator's log (the agent gets ``FETCH_FAILED``)."""


def listed_networks(cfg: ProxyConfig) -> list[Network]:
    """The addresses ``--image-urls`` lists as IPs or networks (``10.0.0.7``, ``10.0.0.0/8``)."""
    out: list[Network] = []
    for entry in cfg.image_urls:
        try:
            out.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            continue  # a host name
    return out


def address_allowed(ip: Address, listed: list[Network]) -> bool:
    """A public address (not loopback, private, link-local, shared, reserved, multicast), or a listed one."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if any(ip in net for net in listed):
        return True
    return ip.is_global and not ip.is_multicast


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_allowed(host: str, cfg: ProxyConfig) -> bool:
    """Whether ``--image-urls`` lets the proxy fetch from this host name (or IP literal) at all."""
    names = {h.lower() for h in cfg.image_urls}
    if "*" in names or host in names:
        return True
    ip = _literal(host)
    return ip is not None and any(ip in net for net in listed_networks(cfg))


class CheckedResolver(AbstractResolver):
    """Resolves a name once and hands the connector only the addresses ``address_allowed`` accepts: the
    connection goes to an address that was checked, never to what a later lookup answers."""

    def __init__(self, listed: list[Network]) -> None:
        self.listed = listed

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             family=family)
        out: list[ResolveResult] = []
        for fam, _, proto, _, sockaddr in infos:
            address = str(sockaddr[0])
            if address_allowed(ipaddress.ip_address(address.split("%", 1)[0]), self.listed):
                out.append({"hostname": host, "host": address, "port": int(sockaddr[1]), "family": fam,
                            "proto": proto, "flags": socket.AI_NUMERICHOST | socket.AI_NUMERICSERV})
        if not out:
            raise _Refused(f"{host} resolves to no address the proxy may fetch from "
                           f"({', '.join(str(i[4][0]) for i in infos)})")
        return out

    async def close(self) -> None:
        pass


async def fetch(url: str, cfg: ProxyConfig, reserve: Callable[[int], None]) -> bytes:
    """The image's bytes (see the module's docstring). ``reserve(n)`` is told what the fetch may hold before
    the body is read (a 429 there refuses it), then, once read, what it holds."""
    host = (urlsplit(url).hostname or "").lower()
    if not host_allowed(host, cfg):
        raise _bad(f"image URLs from {host!r} are not fetched: allow the host with --image-urls HOST (or "
                   "'*'), or send the image as a base64 data URL")
    listed = listed_networks(cfg)
    try:
        ip = _literal(host)
        if ip is not None and not address_allowed(ip, listed):  # the connector resolves no IP literal
            raise _Refused(f"{ip} is not an address the proxy may fetch from")
        return await _read(url, cfg, CheckedResolver(listed), reserve)
    except (_Refused, TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        logger.info("image URL %s refused: %s", url[:200], exc)
        raise _bad(FETCH_FAILED) from None


async def _read(url: str, cfg: ProxyConfig, resolver: CheckedResolver, reserve: Callable[[int], None]
                ) -> bytes:
    limit = cfg.max_image_bytes
    timeout = aiohttp.ClientTimeout(total=cfg.image_url_timeout_s)
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http, \
            http.get(url, allow_redirects=False) as resp:
        if resp.status != 200:
            raise _Refused(f"answered {resp.status}")
        if (resp.content_length or 0) > limit:
            raise _Refused(f"declares {resp.content_length} bytes, past max_image_bytes ({limit})")
        reserve(limit)
        data = bytearray()
        while len(data) <= limit:  # one read returns what one network read brought: read to the end
            chunk = await resp.content.read(limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > limit:
            raise _Refused(f"larger than max_image_bytes ({limit})")
        reserve(len(data))
        return bytes(data)
