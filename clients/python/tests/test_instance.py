"""The client instance name (issue 30): one per process, printable, bounded."""

import os

import latchkey
from latchkey._client import _clean_instance


def test_the_default_names_this_process_and_is_stable(monkeypatch):
    monkeypatch.delenv("LATCHKEY_INSTANCE", raising=False)
    monkeypatch.setenv("POD_NAME", "ledger-7d9f-x2x")
    name = latchkey.default_instance()
    host, pid, nonce = name.split(":")
    assert (host, int(pid)) == ("ledger-7d9f-x2x", os.getpid())
    assert len(nonce) == 8
    assert latchkey.default_instance() == name


def test_an_explicit_instance_wins(monkeypatch):
    monkeypatch.setenv("LATCHKEY_INSTANCE", "worker-3")
    assert latchkey.default_instance() == "worker-3"


def test_names_are_cleaned_to_what_the_arbiter_accepts():
    assert _clean_instance("  pod-1:42 \n") == "pod-1:42"
    assert _clean_instance("a\x1b[2Jb\u202e") == "a[2Jb"
    cut = _clean_instance("é" * 100)
    assert len(cut.encode()) <= 128 and set(cut) == {"é"}
