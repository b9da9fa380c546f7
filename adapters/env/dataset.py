"""Datasets (Agent-R1's parquet rows) and the environment registry (the ``steptap.envs`` entry-point group).

A dataset is a parquet file, one task per row, with Agent-R1's columns:

- ``prompt``: the chat messages to start from (a list of ``{role, content}``, a JSON string of one, or text);
- ``reward_model``: what scores the outcome, e.g. ``{"style": "rule", "ground_truth": "42"}``;
- ``agent_name``: the environment (or flow) that runs the row, by registered name;
- ``env_kwargs``: keyword arguments for the environment's ``reset`` (a struct or a JSON string);

and any other columns (``data_source``, ``extra_info``, ...), kept as the trajectory's metadata.

Environments are found by name like the adapters: a package registers a factory (a class or function that
returns an ``AgentEnv`` or an ``AgentFlowBase``) with one line of ``pyproject.toml``::

    [project.entry-points."steptap.envs"]
    my_task = "my_package.envs:MyEnv"

A name of the form ``module:attr`` or ``path/to/file.py:attr`` is loaded directly (no registration needed),
but only from the user's own ``--env`` or with ``--trust-dataset-code``: a dataset is data, and a row that
could name any file or module to import would make every downloaded dataset code.
pyarrow is imported only when a parquet file is read or written (``pip install 'steptap[env]'``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GROUP = "steptap.envs"
MAX_ROWS = 1_000_000  # a dataset larger than this is refused (rows are held in memory)
KNOWN = ("prompt", "reward_model", "agent_name", "env_kwargs")


class DatasetError(ValueError):
    """A dataset that cannot be run: missing file or column, a bad cell (the row is named)."""


@dataclass
class Row:
    index: int
    prompt: Any
    reward_model: dict[str, Any] = field(default_factory=dict)
    agent_name: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the other columns


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError("parquet datasets need pyarrow: pip install 'steptap[env]'") from exc
    return pyarrow


def _as_dict(value: Any, column: str, index: int) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise DatasetError(f"row {index}: {column} is not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise DatasetError(f"row {index}: {column} must be an object, got {type(value).__name__}")
    # Parquet structs unify keys across rows: a key another row has is None here, not absent.
    return {k: v for k, v in value.items() if v is not None}


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a parquet dataset, validated (``DatasetError`` names the first bad row)."""
    pa = _pyarrow()
    if not Path(path).exists():
        raise DatasetError(f"no dataset at {path}")
    try:
        meta = pa.parquet.ParquetFile(str(path)).metadata
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{path} is not a parquet file: {exc}") from None
    if meta.num_rows > MAX_ROWS:
        raise DatasetError(f"{path} has {meta.num_rows} rows; at most {MAX_ROWS} are supported")
    table = pa.parquet.read_table(str(path))
    if "prompt" not in table.column_names:
        raise DatasetError(f"{path} has no 'prompt' column (columns: {', '.join(table.column_names)})")
    rows = []
    for i, rec in enumerate(table.to_pylist()):
        if rec.get("prompt") in (None, "", []):
            raise DatasetError(f"row {i}: empty prompt")
        name = rec.get("agent_name")
        if name is not None and not isinstance(name, str):
            raise DatasetError(f"row {i}: agent_name must be a string")
        rows.append(
            Row(
                index=i,
                prompt=rec["prompt"],
                reward_model=_as_dict(rec.get("reward_model"), "reward_model", i),
                agent_name=name or None,
                env_kwargs=_as_dict(rec.get("env_kwargs"), "env_kwargs", i),
                extra={k: v for k, v in rec.items() if k not in KNOWN},
            )
        )
    return rows


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write dataset rows (dicts with Agent-R1's columns) as parquet. Text prompts become one user message
    (one column type); ``env_kwargs`` and ``reward_model`` are stored as JSON strings so rows with different
    keys never turn into null-padded structs."""
    from steptap.adapters.env.base import as_messages

    pa = _pyarrow()
    out = []
    for row in rows:
        row = dict(row)
        row["prompt"] = as_messages(row.get("prompt"))
        for col in ("reward_model", "env_kwargs", "extra_info"):
            if isinstance(row.get(col), dict):
                row[col] = json.dumps(row[col])
        out.append(row)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pa.parquet.write_table(pa.Table.from_pylist(out), str(path))
    return Path(path)


# ---- the environment registry -----------------------------------------------------------------------------

Factory = Callable[[], Any]  # -> AgentEnv | AgentFlowBase


def env_names() -> dict[str, str]:
    """Registered environment names -> their targets."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GROUP)}


def resolve_env(name: str, *, allow_code: bool = True) -> Factory:
    """The factory registered as ``name`` in ``steptap.envs``, or (``allow_code``) loaded from ``module:attr``
    / ``file.py:attr``. ``KeyError`` names the registered ones when there is no such environment;
    ``ValueError`` for a module or file name that ``allow_code`` does not admit (nothing is imported)."""
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.name == name:
            return ep.load()
    if ":" in name and not allow_code:
        raise ValueError(f"{name!r} names code to import, not a registered environment: a dataset row may "
                         "name only registered ones (steptap env list); pass --env NAME, or "
                         "--trust-dataset-code if you trust this dataset's code")
    if ":" in name:
        target, _, attr = name.rpartition(":")
        if target.endswith(".py"):
            file = Path(target)
            if not file.is_file():
                raise KeyError(f"no environment file {target}")
            mod_name = f"steptap_env_{file.stem}_{abs(hash(str(file.resolve())))}"
            module = sys.modules.get(mod_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(mod_name, file)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.path.insert(0, str(file.resolve().parent))  # its sibling modules import by name
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        try:
            return getattr(module, attr)
        except AttributeError:
            raise KeyError(f"{target} has no {attr!r}") from None
    known = ", ".join(sorted(env_names())) or "none"
    raise KeyError(f"no steptap environment named {name!r} (registered: {known}; or give module:attr)")
