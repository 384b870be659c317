"""SVID rotation under a long-running client, against the real stack: the
client takes up rotated certificate files by itself, later calls present the
new certificate, and the session and its holds go on without a fence.

A real rotation keeps the identity; here the files are swapped to another
workload's SVID and back, because that is what a call can see from outside
(Inspect shows a holder's session only to the holder's own identity)."""

from __future__ import annotations

import shutil
import time

import latchkey
import latchkey._client as client_module
from conftest import eventually


def _install(env, who: str, into) -> None:
    # Written beside and renamed over, as SPIRE's helper does: no half-read file.
    for part in ("CERT", "KEY"):
        target = into / f"svid.{part.lower()}"
        tmp = into / f".svid.{part.lower()}.tmp"
        shutil.copyfile(env[f"{who}_{part}"], tmp)
        tmp.replace(target)


def _client(env, files) -> latchkey.Client:
    """A client reading its SVID from `files`, where the test rotates it."""
    return latchkey.Client(
        env["ENDPOINT"],
        ca=env["CA"],
        cert=str(files / "svid.cert"),
        key=str(files / "svid.key"),
        default_class="demo",
        connect_timeout=10.0,
    )


def test_a_rotated_svid_is_taken_up_without_a_fence(stack_env, tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "TLS_CHECK_EVERY", 0.1)
    _install(stack_env, "ALICE", tmp_path)
    lost = []
    with _client(stack_env, tmp_path) as client:
        guard = client.acquire("demo/py/rotation", on_fence=lost.append)
        assert client.inspect("demo/py/rotation").holder.session_id == guard.session_id

        # Rotated to bob's SVID: the next calls are bob's, who may not see the session.
        _install(stack_env, "BOB", tmp_path)
        eventually(
            "calls to present the new certificate",
            10,
            lambda: client.inspect("demo/py/rotation").holder.session_id == 0,
        )
        assert client.svid_reloads == 1

        # And back: alice's calls again, her hold as it was.
        _install(stack_env, "ALICE", tmp_path)
        eventually(
            "calls to present alice's certificate again",
            10,
            lambda: client.inspect("demo/py/rotation").holder.session_id == guard.session_id,
        )
        assert client.svid_reloads == 2
        # Longer than the class's keepalive interval: renewals went on.
        time.sleep(6)
        assert not lost and not guard.is_fenced and guard.can_start()
        guard.release()


def test_a_half_written_rotation_is_not_taken_up(stack_env, tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "TLS_CHECK_EVERY", 0.1)
    _install(stack_env, "ALICE", tmp_path)
    with _client(stack_env, tmp_path) as client:
        # bob's certificate with alice's key: not a pair.
        shutil.copyfile(stack_env["BOB_CERT"], tmp_path / "svid.cert")
        time.sleep(0.2)
        with client.lock("demo/py/half-rotation"):
            pass
        assert client.svid_reloads == 0
