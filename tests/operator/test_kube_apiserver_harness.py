"""How the kube-apiserver harness fails: every failure is a HarnessError that says why.

These need no apiserver build (a broken recipe fails while Go parses it) and run in seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.harness import kube_apiserver
from tests.harness.go_build import GoMissing
from tests.harness.kube_apiserver import KubeApiServer, build, recipe_hash
from tests.harness.system import HarnessError


@pytest.fixture
def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the recipe, and a private harness cache."""
    directory = tmp_path / "recipe"
    shutil.copytree(kube_apiserver.RECIPE_DIR, directory)
    monkeypatch.setattr(kube_apiserver, "RECIPE_DIR", directory)
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path / "cache"))
    return directory


def test_recipe_hash_covers_sources_and_go_version(recipe: Path) -> None:
    before = recipe_hash("go1.26.8")
    assert recipe_hash("go1.26.9") != before
    (recipe / "main.go").write_text((recipe / "main.go").read_text() + "\n// changed\n")
    assert recipe_hash("go1.26.8") != before


def test_build_without_go_is_reported_as_missing_go(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(GoMissing, match="need Go"):
        build()


@pytest.mark.skipif(shutil.which("go") is None, reason="needs Go")
def test_failed_build_raises_with_the_compiler_output(recipe: Path) -> None:
    # A module without requirements, so that nothing is downloaded before the parse fails.
    (recipe / "go.mod").write_text("module broken\n\ngo 1.26.0\n")
    (recipe / "go.sum").write_text("")
    (recipe / "main.go").write_text("package main\n\nfunc main() {\n")
    with pytest.raises(HarnessError) as caught:
        build(progress=lambda _: None)
    message = str(caught.value)
    assert "exited with" in message and "main.go" in message, message
    assert not list((recipe.parent / "cache" / "kube-apiserver").glob("bin-*/kube-apiserver"))


def test_server_that_exits_at_start_raises_with_its_log(tmp_path: Path) -> None:
    binary = tmp_path / "kube-apiserver"
    binary.write_text("#!/bin/sh\necho 'unknown flag: --nonsense' >&2\nexit 3\n")
    binary.chmod(0o755)
    server = KubeApiServer(binary, operator_user="default/op", progress=lambda _: None)
    with pytest.raises(HarnessError, match=r"exited with 3(.|\n)*unknown flag: --nonsense"):
        server.start()
    assert not server.workdir.exists()  # its temporary files are gone


@pytest.mark.parametrize("user", ["op", "default/", "/op", ""])
def test_operator_user_must_name_a_namespace_and_account(user: str) -> None:
    with pytest.raises(HarnessError, match="namespace/name"):
        KubeApiServer(Path("/nonexistent"), operator_user=user)
