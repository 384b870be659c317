"""Configuration as latchctl reads it, and a library that stays quiet: no
stack needed."""

import logging

import pytest

import latchkey
from latchkey import ConfigError


def test_the_library_logs_nowhere_unless_the_application_says_so():
    handlers = logging.getLogger("latchkey").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_from_env_names_what_is_missing(monkeypatch):
    for v in ("LATCHKEY_ENDPOINT", "LATCHKEY_CA", "LATCHKEY_CERT", "LATCHKEY_KEY", "LATCHKEY_TLS_DOMAIN"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("LATCHKEY_CA", "/nonexistent/ca.pem")
    with pytest.raises(ConfigError) as e:
        latchkey.Client.from_env()
    assert "LATCHKEY_CERT" in str(e.value) and "LATCHKEY_KEY" in str(e.value)
    assert "LATCHKEY_CA" not in str(e.value)


def test_from_env_reads_the_files_latchctl_would(monkeypatch, tmp_path):
    monkeypatch.setenv("LATCHKEY_ENDPOINT", "https://127.0.0.1:1")
    for v, name in (("LATCHKEY_CA", "ca.pem"), ("LATCHKEY_CERT", "svid.pem"), ("LATCHKEY_KEY", "svid.key")):
        monkeypatch.setenv(v, str(tmp_path / name))
    # The files do not exist: the error names the one read first, so the
    # paths came from the environment.
    with pytest.raises(ConfigError) as e:
        latchkey.Client.from_env()
    assert "ca.pem" in str(e.value), str(e.value)


def test_a_lock_without_a_timeout_waits_forever():
    assert latchkey.FOREVER == float("inf")
    assert 0 < latchkey.WAIT_ASK < 60
