"""(tests/harbor_fakes/) Loaded into Harbor's own virtualenv by `steptap tasks run --sandbox harbor` in tests
(STEPTAP_HARBOR_PYTHONPATH): a fake container runtime and a small agent, named by import path, for the one
thing this machine cannot do (it has a docker client and no daemon, and no registry to pull from).

``BwrapEnvironment`` stands in for a container: its filesystem is a folder of folders on the host (/app,
/tests, /logs, /solution, /installed-agent, /tmp), each command run by bubblewrap over the host's system,
read-only, with them bound in; ``environment/app/`` is copied to /app as the task's Dockerfile (``COPY app/
/app/``) would. It shares the host's network, as a container on the host network does. ``ToolAgent`` is an
agent of the kind Harbor's terminus is: it calls its model from the host, at the base URL and with the key
Harbor hands it (``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` in its env), with one ``bash`` tool, and runs each
tool call in the environment, for at most four turns. Everything else is Harbor's own: its trial, its
verifier, its results.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.models.agent.context import AgentContext

TOPS = ("app", "tests", "logs", "solution", "installed-agent", "tmp", "root")


class BwrapEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "steptap-fake-bwrap"

    def _validate_definition(self) -> None:
        if not (self.environment_dir / "Dockerfile").is_file():
            raise FileNotFoundError(f"{self.environment_dir}/Dockerfile not found")

    async def start(self, force_build: bool) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="steptap-fake-container-"))
        for top in TOPS:
            (self.root / top).mkdir()
        for logs in ("agent", "verifier", "artifacts"):  # what a container runtime's mounts provide
            (self.root / "logs" / logs).mkdir()
        app = self.environment_dir / "app"
        if app.is_dir():
            shutil.copytree(app, self.root / "app", dirs_exist_ok=True)

    async def stop(self, delete: bool) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _host(self, path: str) -> Path:
        parts = Path(path).parts
        if len(parts) < 2 or parts[1] not in TOPS:
            raise ValueError(f"the fake container has no {path}")
        return self.root.joinpath(*parts[1:])

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        self._host(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source_path, self._host(target_path))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        shutil.copytree(source_dir, self._host(target_dir), dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self._host(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        shutil.copytree(self._host(source_dir), target_dir, dirs_exist_ok=True)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        argv = ["bwrap", "--die-with-parent", "--unshare-pid", "--ro-bind", "/usr", "/usr", "--ro-bind",
                "/etc", "/etc", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink",
                "usr/lib64", "/lib64", "--dev", "/dev", "--proc", "/proc"]
        for top in TOPS:
            argv += ["--bind", str(self.root / top), f"/{top}"]
        for key, value in {"PATH": "/usr/bin:/bin", "HOME": "/root", **(self._merge_env(env) or {})}.items():
            argv += ["--setenv", key, value]
        argv += ["--chdir", cwd or self.task_env_config.workdir or "/app", "bash", "-c", command]
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                          return_code=proc.returncode or 0)


BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                         "parameters": {"type": "object", "required": ["command"],
                                                        "properties": {"command": {"type": "string"}}}}}


class ToolAgent(BaseAgent):
    @staticmethod
    def name() -> str:
        return "steptap-tool-agent"

    def version(self) -> str:
        return "1.0.0"

    async def setup(self, environment: BaseEnvironment) -> None:
        pass

    def _call(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        base, key = self._extra_env["OPENAI_BASE_URL"], self._extra_env["OPENAI_API_KEY"]
        body = {"model": self._extra_env["OPENAI_MODEL"], "messages": messages, "tools": [BASH],
                "max_tokens": 256}
        req = urllib.request.Request(f"{base}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            return dict(json.loads(resp.read())["choices"][0]["message"])

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": instruction}]
        for _ in range(4):
            reply = await asyncio.to_thread(self._call, messages)
            messages.append({k: v for k, v in reply.items() if k in ("role", "content", "tool_calls")})
            calls = reply.get("tool_calls") or []
            if not calls:
                return
            for call in calls:
                command = json.loads(call["function"]["arguments"]).get("command", "")
                result = await environment.exec(command)
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": (result.stdout or "") + (result.stderr or "")})
