"""Where the embedded corpus is cached: data.embedded_dir, data.cache_dir, XDG_CACHE_HOME, ~/.cache."""

from __future__ import annotations

import pytest

from megatron_mhar.data.corpus import embedded_root, prepare_embedded


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh home directory and no XDG_CACHE_HOME."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path / "home"


def test_embedded_root_precedence(home, tmp_path, monkeypatch):
    assert embedded_root() == home / ".cache" / "megatron_mhar" / "embedded"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded_root() == tmp_path / "xdg" / "megatron_mhar" / "embedded"
    assert embedded_root(cache_dir=str(tmp_path / "c")) == tmp_path / "c" / "embedded"
    assert embedded_root(str(tmp_path / "e"), str(tmp_path / "c")) == tmp_path / "e"
    assert embedded_root("~/corpus") == home / "corpus"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid per the XDG spec: ignored
    assert embedded_root() == home / ".cache" / "megatron_mhar" / "embedded"


def test_a_build_says_where_it_goes_and_honours_xdg(home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    built = prepare_embedded(None, 300, 20_000)
    assert built.directory.parent == tmp_path / "xdg" / "megatron_mhar" / "embedded"
    out = capsys.readouterr().out
    assert "building the embedded corpus once" in out and str(built.directory) in out
    assert not home.exists()  # nothing written under ~/.cache
    prepare_embedded(None, 300, 20_000)
    assert capsys.readouterr().out == ""  # cached: silent

