"""The distribution and the layering: every module ships in the package mapping, and the proxy side never
imports the ML stack (ARCHITECTURE.md, "Layout")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"middleware": "steptap.middleware", "adapters": "steptap.adapters", "learner": "steptap.learner"}
HEAVY = ("torch", "transformers", "ray", "verl", "peft")
# Sources that run inside vLLM's own venv (installed there by launch/plugin.py), never imported by steptap.
VLLM_SIDE = Path("middleware/launch/vllm_plugin")


def _source_modules() -> list[str]:
    names = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if (ROOT / VLLM_SIDE) in path.parents:
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.append(".".join([package, *parts]))
    return names


def _run(code: str) -> dict:
    # A fresh interpreter outside the repo root, so only the installed package can be imported.
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_source_module_is_importable_from_the_installed_package() -> None:
    modules = _source_modules()
    assert "steptap.middleware.records" in modules
    result = _run(
        "import importlib, json, sys\n"
        f"mods = {modules!r}\n"
        "files = {m: importlib.import_module(m).__file__ for m in mods}\n"
        "print(json.dumps(files))"
    )
    assert set(result) == set(modules)
    if os.environ.get("STEPTAP_WHEEL_TEST") == "1":
        # scripts/test.sh installed the built wheel: nothing may come from the source folders.
        leaked = {m: f for m, f in result.items() if not f.startswith(sys.prefix)}
        assert not leaked, f"modules imported from outside the installed wheel: {leaked}"


@pytest.mark.parametrize("package", ["steptap.middleware", "steptap.adapters"])
def test_proxy_side_never_imports_the_ml_stack(package: str) -> None:
    folder = next(f for f, p in PACKAGES.items() if p == package)
    modules = [m for m in _source_modules() if m.startswith(package)]
    assert modules, folder
    loaded = _run(
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))"
    )
    assert loaded == [], f"{package} imported {loaded}"


def test_cli_lists_every_command_without_the_ml_stack() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from steptap.middleware.cli.main import main; main(['--help']);"
         f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    for command in ("serve", "vllm", "learn", "up", "run", "tiny-model", "adapters", "plot", "env", "eval",
                    "export"):
        assert f"  {command} " in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --- the import arrows (docs/design.md, "Layering"), read from the source with ast --------------------------
# Within the middleware: routes -> domain -> log; proxy may use sessions and weights; sessions and weights
# reach the log only through its protocol (no import of log/); launch/ depends on nothing but the kernel (it
# drives the others through their command lines). The kernel (the modules directly in middleware/, and the
# rooms every part shares: client/, cli/) imports no other room; the composition roots (app.py, server/) may
# import every room.
SUBPACKAGES = ("proxy", "sessions", "log", "weights", "launch", "backend", "console")
ALLOWED = {
    "kernel": set(),
    "proxy": {"sessions", "weights", "backend"},
    "sessions": set(),
    "log": set(),
    "weights": {"backend"},
    "launch": set(),
    "backend": set(),
    "console": {"sessions", "log", "weights", "backend"},  # a view over them all, and curation into the log
}
# backend/url.py is stdlib only: the one URL parser (and its check), shared with both of the kernel's clients
# (client/api.py's proxy_url) and the launchers.
SHARED = {"steptap.middleware.backend.url", "steptap.middleware.backend.url.BackendUrl",
          "steptap.middleware.backend.url.problem"}
ROOTS = {"app", "server"}  # app.py and server/: may import every part
ML = {"torch", "transformers", "ray", "verl", "peft", "accelerate", "vllm"}
LAUNCH_ONLY = {"rich", "psutil"}


def _imports(path: Path) -> set[str]:
    """Every module name a file imports, at any depth (lazy imports inside functions count too)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _middleware_part(module: str) -> str | None:
    """'proxy' for steptap.middleware.proxy.relay, 'kernel' for steptap.middleware.records, None outside."""
    parts = module.split(".")
    if parts[:2] != ["steptap", "middleware"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SUBPACKAGES else "kernel"


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if (ROOT / VLLM_SIDE) not in p.parents)


def test_middleware_imports_follow_the_arrows() -> None:
    wrong = []
    for path in _files("middleware"):
        rel = path.relative_to(ROOT / "middleware")
        if rel.parts[0] in SUBPACKAGES:
            part = rel.parts[0]
        elif rel.parts[0].removesuffix(".py") in ROOTS:
            continue
        else:
            part = "kernel"
        for name in _imports(path):
            target = _middleware_part(name)
            if target is None or name in SHARED:
                continue
            if target == "kernel" and name.split(".")[2] in ROOTS:
                wrong.append(f"{rel}: imports {name} (only the composition roots are app.py, server/)")
            elif target not in ("kernel", part) and target not in ALLOWED[part]:
                wrong.append(f"{rel} ({part}) imports {name} ({target})")
        top = {n.split(".")[0] for n in _imports(path)}
        if top & ML:
            wrong.append(f"{rel}: imports the ML stack {sorted(top & ML)}")
        if top & LAUNCH_ONLY and part != "launch":
            wrong.append(f"{rel}: imports {sorted(top & LAUNCH_ONLY)} outside launch/")
        if any(n.startswith(("steptap.learner", "steptap.adapters")) for n in _imports(path)):
            wrong.append(f"{rel}: the middleware imports the learner or the adapters")
    assert not wrong, "\n".join(wrong)


def test_learner_and_adapters_use_only_the_middleware_kernel() -> None:
    """The learner and the adapters talk to the proxy over HTTP (client.py) and share its record schema; they
    never import its server parts. The one exception: adapters may read a log directory through the log's
    read-only offline reader (``steptap export --log``) and build Harbor's virtualenv the one way vLLM's is
    built (``launch/venvs.py``, stdlib only), and the learner seals its transfer store with the one store the
    vLLM plugin joins through (``vllm_plugin/steptap_sealed_store.py``, torch only)."""
    wrong = []
    for folder in ("learner", "adapters"):
        for path in _files(folder):
            rel = f"{folder}/{path.relative_to(ROOT / folder)}"
            for name in _imports(path):
                part = _middleware_part(name)
                if part is None or part == "kernel" and name.split(".")[2] not in ROOTS or name in SHARED:
                    continue
                if folder == "adapters" and name.startswith(("steptap.middleware.log.offline",
                                                             "steptap.middleware.launch.venvs")):
                    continue
                sealed = "steptap.middleware.launch.vllm_plugin.steptap_sealed_store"
                if folder == "learner" and name.startswith(sealed):
                    continue
                wrong.append(f"{rel} imports {name}")
            if folder == "adapters":
                heavy = {n.split(".")[0] for n in _imports(path)} & ML
                if heavy:
                    wrong.append(f"{rel}: imports the ML stack {sorted(heavy)}")
                if any(n.startswith("steptap.learner") for n in _imports(path)):
                    wrong.append(f"{rel}: imports the learner")
            elif any(n.startswith("steptap.adapters") for n in _imports(path)):
                wrong.append(f"{rel}: the learner imports the adapters")
    assert not wrong, "\n".join(wrong)


def test_every_subpackage_is_in_the_wheel_mapping() -> None:
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, package in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([package, *rel.parts]))
    # the vLLM plugin has no __init__.py (it is never imported here) but ships as a declared package of files
    assert (ROOT / VLLM_SIDE / "steptap_vllm_plugin.py").is_file()
    on_disk.add("steptap.middleware.launch.vllm_plugin")
    # the console's page: html, js and css, a declared package of files too
    assert (ROOT / "middleware" / "console" / "static" / "index.html").is_file()
    on_disk.add("steptap.middleware.console.static")
    assert on_disk == listed, f"missing from pyproject: {on_disk - listed}; stale: {listed - on_disk}"


def test_the_virtualenvs_pins_ship_in_the_package() -> None:
    """The constraints files the vLLM and Harbor virtualenvs are built under are package data: found beside
    their modules in the installed package (scripts/test.sh installs the wheel), one pin a line."""
    from steptap.adapters.tasks.containers import HARBOR_CONSTRAINTS
    from steptap.middleware.launch.vllm_venv import CPU_CONSTRAINTS

    for pins in (CPU_CONSTRAINTS, HARBOR_CONSTRAINTS):
        lines = [ln for ln in pins.read_text().splitlines() if ln and not ln.startswith("#")]
        assert len(lines) > 50 and all(ln.count("==") == 1 and " " not in ln for ln in lines), pins


# --- one client for vLLM (backend/) -------------------------------------------------------------------------
# Routes only vLLM serves (the proxy serves /v1/models and /health itself, so those cannot tell).
VLLM_ROUTES = ("/pause", "/resume", "/is_paused", "/collective_rpc", "reset_prefix_cache",
               "reset_encoder_cache",
               "load_lora_adapter",
               "update_weight_version", "/weight_info", "/server_info", "get_world_size",
               "weight_transfer_engine",
               "weight_update", "/update_weights", "/render", "/derender", "/inference/v1/generate")
# What opens an HTTP client session; outside backend/ only the kernel's client of the proxy itself may.
SESSION_MAKERS = {"ClientSession", "TCPConnector", "UnixConnector", "request", "get", "post"}
PROXY_CLIENT = Path("client/stream.py")  # the proxy's own async client (its control API, not vLLM)
IMAGE_FETCH = Path("proxy/image_urls.py")  # fetches an image URL from a host --image-urls allows (never vLLM)


def vllm_http_outside_backend(root: Path) -> list[str]:
    """Source under ``root`` (a middleware tree) that speaks vLLM's HTTP itself instead of through backend/:
    a vLLM-only route in a string, or an aiohttp session, connector or request made outside backend/."""
    import ast

    wrong = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "backend" or (root / VLLM_SIDE.relative_to("middleware")) in path.parents:
            continue
        tree = ast.parse(path.read_text())
        aliases = {"aiohttp"} | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                                 for a in n.names if a.name == "aiohttp"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                hit = next((r for r in VLLM_ROUTES if r in node.value), None)
                if hit and not node.value.startswith(("--",
                                                      " ")) and "/" in node.value and " " not in node.value:
                    wrong.append(f"{rel}:{node.lineno}: vLLM route {node.value!r}")
            elif isinstance(node, ast.ImportFrom) and node.module == "aiohttp" and rel not in (PROXY_CLIENT,
                                                                                               IMAGE_FETCH):
                made = {a.name for a in node.names} & SESSION_MAKERS
                if made:
                    wrong.append(f"{rel}:{node.lineno}: imports aiohttp.{sorted(made)[0]}")
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in aliases
                  and node.attr in SESSION_MAKERS and rel not in (PROXY_CLIENT, IMAGE_FETCH)):
                wrong.append(f"{rel}:{node.lineno}: aiohttp.{node.attr}")
    return wrong


def test_only_backend_speaks_vllm_http() -> None:
    """proxy/ and weights/ reach vLLM only through backend/ (one client per replica, errors naming it)."""
    wrong = vllm_http_outside_backend(ROOT / "middleware")
    assert not wrong, "\n".join(wrong)


def test_the_vllm_http_check_catches_a_session_and_a_route(tmp_path: Path) -> None:
    """The check above fails on the two ways back: an aiohttp session of one's own, a vLLM route by hand."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "swapper.py").write_text(
        "import aiohttp as h\nfrom aiohttp import ClientSession\n"
        "async def f(base):\n    async with h.ClientSession() as s:\n"
        "        await s.post(base + '/pause?mode=wait')\n")
    found = vllm_http_outside_backend(tmp_path)
    assert any("aiohttp.ClientSession" in w for w in found), found
    assert any("imports aiohttp.ClientSession" in w for w in found), found
    assert any("'/pause?mode=wait'" in w for w in found), found
    (tmp_path / "backend").mkdir()
    (tmp_path / "weights" / "swapper.py").rename(tmp_path / "backend" / "client.py")
    assert vllm_http_outside_backend(tmp_path) == []


# Domain modules never import aiohttp: their AppKeys live in their routes modules (sessions/control.py,
# log/stream.py, weights/routes.py), so the domain reads as plain Python and runs outside a web app.
DOMAIN = ("sessions", "log", "weights")
DOMAIN_ROUTES = {"control.py", "stream.py", "routes.py"}


def aiohttp_in_domain(root: Path) -> list[str]:
    return [f"{p.relative_to(root)}: imports aiohttp" for part in DOMAIN
            for p in sorted((root / part).rglob("*.py"))
            if p.name not in DOMAIN_ROUTES and any(n.split(".")[0] == "aiohttp" for n in _imports(p))]


def test_the_session_log_and_swap_domains_import_no_aiohttp(tmp_path: Path) -> None:
    wrong = aiohttp_in_domain(ROOT / "middleware")
    assert not wrong, "\n".join(wrong)
    (tmp_path / "weights").mkdir()  # and the check fails on a wrong import
    (tmp_path / "weights" / "swapper.py").write_text("from aiohttp import web\nKEY = web.AppKey('k', int)\n")
    assert aiohttp_in_domain(tmp_path) == ["weights/swapper.py: imports aiohttp"]


# The size cap this file held (450 lines) became a target; what it meant is in test_rooms.py: no class spread
# over mixin files, no function over 60 lines, rooms of one reason to change.


def test_test_files_have_unique_basenames() -> None:
    # pytest's default ("prepend") import mode keys test modules by basename: two files of one name in
    # tests/unit and tests/integration stop the whole run at collection (it happened: test_older_vllm).
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path
