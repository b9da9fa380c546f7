"""Concepts that were defined twice with different answers (issue 19): each now has one definition, and each
test here fails when a second one with another answer comes back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from steptap.middleware import client

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("middleware", "adapters", "learner")
           for p in sorted((ROOT / folder).rglob("*.py"))]


def _string_constants(path: Path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


# --- the control-token file and its environment variables ---------------------------------------------------

@pytest.mark.parametrize(("text", "token"), [("stc-abc\n", "stc-abc"),
                                             ("  stc-abc  \n\nignored\n", "stc-abc"),
                                              ("stc-a b\n", "stc-a b")])
def test_every_reader_of_a_token_file_gets_the_same_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, token: str) -> None:
    path = tmp_path / "control_token"
    path.write_text(text)
    monkeypatch.delenv(client.TOKEN_ENV, raising=False)
    monkeypatch.setenv(client.TOKEN_FILE_ENV, str(path))
    # the drivers' and the clients' way (the environment) and serve's and up's (the file) agree
    assert client.read_token_file(path) == client.default_control_token() == token


def test_an_empty_token_file_is_an_error_for_every_reader(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "control_token"
    path.write_text("\n")
    monkeypatch.delenv(client.TOKEN_ENV, raising=False)
    monkeypatch.setenv(client.TOKEN_FILE_ENV, str(path))
    with pytest.raises(ValueError, match="empty token file"):
        client.read_token_file(path)
    with pytest.raises(ValueError, match="empty token file"):
        client.default_control_token()


def test_the_token_variables_are_named_in_one_place() -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line}" for p in SOURCES if p != ROOT / "middleware/client/tokens.py"
             for line, value in _string_constants(p) if value in (client.TOKEN_ENV, client.TOKEN_FILE_ENV)]
    assert not wrong, "spell them client.TOKEN_ENV / client.TOKEN_FILE_ENV: " + ", ".join(wrong)
    defs = [p.relative_to(ROOT) for p in SOURCES if "def read_token_file" in p.read_text()]
    assert defs == [Path("middleware/client/tokens.py")]


# --- error -> status: one map, used by the edge for every domain error --------------------------------------

def test_every_domain_error_has_its_status_in_the_one_map() -> None:
    from steptap.middleware import errors, exceptions

    def subclasses(cls: type) -> list[type]:
        return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]

    missing = [c.__name__ for c in subclasses(exceptions.DomainError)
               # Others inherit their base's
               if c.__module__ == exceptions.__name__ and c not in errors._STATUS]
    assert not missing, f"add to errors._STATUS: {missing}"
    order = list(errors._STATUS)
    shadowed = [(a.__name__, b.__name__) for i, a in enumerate(order) for b in order[i + 1:]
                if issubclass(b, a)]
    assert not shadowed, f"a subclass after its base never gets its own status: {shadowed}"


def test_a_refused_swap_and_a_bad_session_id_answer_with_the_maps_status() -> None:
    from steptap.middleware import errors, exceptions

    refused = errors.api_error(exceptions.SwapRefused("bad weights", "weights_not_found"))
    assert (refused.status, refused.code) == (400, "weights_not_found")
    assert errors.status_of(exceptions.StaleVersion("old")) == 409
    assert errors.status_of(exceptions.SwapError("failed", "backend_error")) == 502
    assert errors.status_of(exceptions.InvalidRequest("bad id", "invalid_session_id")) == 400


def test_only_routes_build_http_errors() -> None:
    """Domain modules raise domain errors; ``ApiError(status, ...)`` is built only at the edge (routes,
    app)."""
    routes = {"control.py", "stream.py", "routes.py", "relay.py", "validate.py", "protocols.py",
              "responses.py",
              "translation.py", "messages.py", "errors.py", "auth.py"}
    wrong = [str(p.relative_to(ROOT)) for p in SOURCES if p.parts[-3:-1][-1] in ("sessions", "log", "weights",
             "backend") and p.name not in routes and "ApiError" in p.read_text()]
    assert not wrong, wrong


# --- private directories: one function (0700, new entries synced in their parent) ---------------------------

def test_private_dir_is_0700_and_synced_in_its_parent(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from steptap.middleware import files

    synced: list[Path] = []
    real = files.fsync_path
    monkeypatch.setattr(files, "fsync_path", lambda p: (synced.append(Path(p)), real(p))[1])
    made = files.private_dir(tmp_path / "work" / "run")
    assert synced == [tmp_path, tmp_path / "work"]  # each new directory's entry is durable
    assert (made.stat().st_mode & 0o777, (tmp_path / "work").stat().st_mode & 0o777) == (0o700, 0o700)
    made.chmod(0o755)
    # An existing one is the user's: left as it is
    assert files.private_dir(made).stat().st_mode & 0o777 == 0o755


def test_private_dirs_are_made_in_one_place() -> None:
    defs = [p.relative_to(ROOT) for p in SOURCES if "def private_dir" in p.read_text()]
    assert defs == [Path("middleware/files.py")]


# --- struct -> flags: one generator, one help source --------------------------------------------------------

def test_flags_are_generated_from_a_struct_in_one_place() -> None:
    # a module that loops over a Struct's fields and adds arguments is a second generator
    def generates(path: Path) -> bool:
        text = path.read_text()
        loops = [ast.unparse(n.iter) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.For)]
        return "add_argument" in text and any(w in it for it in loops
                                              for w in ("__struct_fields__", "structs.fields"))

    assert [p.relative_to(ROOT) for p in SOURCES if generates(p)] == [Path("middleware/cli/flags.py")]


def test_every_generated_flag_s_help_is_its_field_s_description() -> None:
    import argparse
    import typing

    import msgspec

    from steptap.learner.config import LearnerConfig, add_config_flags
    from steptap.middleware.config import ProxyConfig
    from steptap.middleware.server.serve import add_proxy_flags

    for struct, add in ((ProxyConfig, add_proxy_flags), (LearnerConfig, add_config_flags)):
        parser = argparse.ArgumentParser()
        add(parser)
        hints = typing.get_type_hints(struct, include_extras=True)
        for action in parser._actions:  # argparse keeps no public list of its actions
            if action.dest not in hints or action.help == argparse.SUPPRESS or action.dest.endswith("_file"):
                continue
            meta = [m for m in getattr(hints[action.dest], "__metadata__", ()) if isinstance(m, msgspec.Meta)]
            assert meta and meta[0].description, f"{struct.__name__}.{action.dest} has no description"
            assert meta[0].description in (action.help or ""), action.dest
