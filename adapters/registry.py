"""The adapter registry: the ``steptap.adapters`` entry-point group, and ``steptap adapters``.

An adapter binds one agent framework to a steptap session (its base URL and API key). Ours and third-party
ones are found the same way, through the entry-point group, so a package can ship its own with one line of
``pyproject.toml``::

    [project.entry-points."steptap.adapters"]
    myframework = "my_package.steptap_adapter:ADAPTER"

where ``ADAPTER`` is an :class:`Adapter` (or any object with ``name``, ``framework``, ``available()`` and
``bind(session, **kw)``). Loading an entry point imports only the adapter module, never its framework.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GROUP = "steptap.adapters"


@dataclass(frozen=True)
class Adapter:
    """One framework's binding.

    ``framework`` is the pip distribution to install; ``modules`` the import names that must be importable for
    ``available()``; ``binder(session, **kw)`` builds the framework object (imported lazily, inside it)."""

    name: str
    framework: str
    binder: Callable[..., Any]
    modules: tuple[str, ...] = ()
    description: str = ""

    def available(self) -> bool:
        mods = self.modules or (self.framework.replace("-", "_"),)
        try:
            return all(importlib.util.find_spec(m) is not None for m in mods)
        except (ImportError, ValueError):
            return False

    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.framework)
        except importlib.metadata.PackageNotFoundError:
            return None

    def bind(self, session: Any, **kw: Any) -> Any:
        """The framework object bound to ``session`` (anything with ``base_url`` and ``api_key``)."""
        if not self.available():
            raise ImportError(
                f"the {self.name} adapter needs {self.framework!r}: pip install {self.framework} "
                f"(or pip install 'steptap[frameworks]')"
            )
        return self.binder(session, **kw)


@dataclass
class Entry:
    """An installed entry point, loaded or not."""

    name: str
    target: str
    distribution: str | None
    adapter: Any = None
    error: str | None = None

    @property
    def available(self) -> bool:
        if self.adapter is None:
            return False
        try:
            return bool(self.adapter.available())
        except Exception:  # noqa: BLE001 - a third-party adapter must not break the listing
            return False


def entries() -> list[Entry]:
    """Every adapter registered in the entry-point group, loaded (a broken one carries its error)."""
    out: list[Entry] = []
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.name in seen:  # an editable install can list the same distribution twice
            continue
        seen.add(ep.name)
        dist = ep.dist.name if ep.dist is not None else None
        entry = Entry(name=ep.name, target=ep.value, distribution=dist)
        try:
            entry.adapter = ep.load()
        except Exception as exc:  # noqa: BLE001 - report, do not crash the listing
            entry.error = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    return sorted(out, key=lambda e: e.name)


def get(name: str) -> Any:
    """The adapter registered under ``name``; KeyError (with the known names) when there is none."""
    for entry in entries():
        if entry.name == name:
            if entry.adapter is None:
                raise ImportError(f"adapter {name!r} ({entry.target}) failed to load: {entry.error}")
            return entry.adapter
    known = ", ".join(e.name for e in entries()) or "none"
    raise KeyError(f"no steptap adapter named {name!r} (installed: {known})")


def bind(name: str, session: Any, **kw: Any) -> Any:
    """Shortcut: ``registry.bind("langchain", s, model=...)``."""
    return get(name).bind(session, **kw)


def _row(entry: Entry) -> dict[str, Any]:
    ad = entry.adapter
    version = None
    if ad is not None and hasattr(ad, "version"):
        try:
            version = ad.version()
        except Exception:  # noqa: BLE001
            version = None
    return {
        "name": entry.name,
        "framework": getattr(ad, "framework", None),
        "available": entry.available,
        "version": version,
        "target": entry.target,
        "distribution": entry.distribution,
        "description": getattr(ad, "description", "") if ad is not None else "",
        "error": entry.error,
    }


def main(argv: list[str] | None = None) -> int:
    """``steptap adapters``: list the installed adapters and whether their framework is importable."""
    parser = argparse.ArgumentParser(prog="steptap adapters", description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON (one object per adapter)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows = [_row(e) for e in entries()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no steptap adapters installed (entry-point group 'steptap.adapters')")
        return 0
    width = max(len(r["name"]) for r in rows)
    fwidth = max(len(r["framework"] or "?") for r in rows)
    for r in rows:
        if r["error"]:
            state = f"broken: {r['error']}"
        elif r["available"]:
            state = f"available ({r['version']})" if r["version"] else "available"
        else:
            state = f"missing: pip install {r['framework']}"
        print(f"{r['name']:<{width}}  {r['framework'] or '?':<{fwidth}}  {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
