"""A TLS setup that cannot work is named at once (issue 37): a CA that did
not sign Envoy's certificate, a server name the certificate does not have, a
key that is not the SVID's. Before, each waited connect_timeout and said only
"could not connect ... (mTLS)"."""

from __future__ import annotations

import subprocess
import time

import pytest

import latchkey


def _client(env, **overrides):
    options = dict(
        ca=env["CA"],
        cert=env["ALICE_CERT"],
        key=env["ALICE_KEY"],
        default_class="demo",
        connect_timeout=10.0,
    )
    options.update(overrides)
    return latchkey.Client(env["ENDPOINT"], **options)


@pytest.fixture
def other_ca(tmp_path):
    """A CA of another trust domain (an SVID's file holds its chain, CA
    included, so no SVID file will do)."""
    cert = tmp_path / "other-ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(tmp_path / "other-ca.key"), "-out", str(cert), "-subj", "/CN=another trust domain",
         "-days", "1"],
        check=True,
        capture_output=True,
    )
    return str(cert)


@pytest.mark.parametrize(
    "what, overrides, says",
    [
        ("a CA that did not sign the server's certificate", {"ca": "OTHER_CA"}, "does not verify against the CA bundle"),
        ("a server name the certificate does not have", {"server_name": "not-the-arbiter.example"}, "does not name"),
        ("a key that is not the certificate's", {"key": "BOB_KEY"}, "is not the key of the SVID certificate"),
    ],
)
def test_a_wrong_tls_setup_is_named_at_once(stack_env, other_ca, what, overrides, says):
    files = dict(stack_env, OTHER_CA=other_ca)
    resolved = {k: (files[v] if v in files else v) for k, v in overrides.items()}
    began = time.monotonic()
    with pytest.raises(latchkey.ConfigError) as raised:
        _client(stack_env, **resolved).close()
    took = time.monotonic() - began
    assert says in str(raised.value), f"{what}: {raised.value}"
    # connect_timeout is 10 s: the cause comes long before it.
    assert took < 3.0, f"{what}: took {took:.1f} s"


def test_the_right_setup_still_connects(stack_env):
    with _client(stack_env) as client:
        with client.lock("demo/tls-ok", timeout=5) as guard:
            assert guard.token.value > 0
