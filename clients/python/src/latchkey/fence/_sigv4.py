"""AWS Signature Version 4 for S3 requests, header form, with the payload's
SHA-256 signed (``x-amz-content-sha256``): the same signing as the Rust
crate's ``fence/s3/src/sigv4.rs``, checked against the same vectors (AWS's
published S3 example and a PUT signed by botocore's ``S3SigV4Auth``)."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Optional, Sequence, Tuple

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~")


class Credentials:
    """An access key pair; the secret and the session token never print."""

    __slots__ = ("access_key", "_secret_key", "_session_token")

    def __init__(self, access_key: str, secret_key: str, session_token: Optional[str] = None) -> None:
        if not access_key or not secret_key:
            raise ValueError("S3 credentials need an access key id and a secret access key")
        self.access_key = access_key
        self._secret_key = secret_key
        self._session_token = session_token or None

    @property
    def secret_key(self) -> str:
        return self._secret_key

    @property
    def session_token(self) -> Optional[str]:
        return self._session_token

    def __repr__(self) -> str:
        token = "<redacted>" if self._session_token else None
        return f"Credentials(access_key={self.access_key!r}, secret_key=<redacted>, session_token={token})"

    def __reduce__(self):
        raise TypeError("S3 credentials are not picklable")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def uri_encode(text: str, keep_slash: bool) -> str:
    """S3's URI encoding: unreserved characters kept, every other byte
    ``%XX`` (upper-case hex); ``/`` kept in paths."""
    out = []
    for b in text.encode("utf-8"):
        if b in _UNRESERVED or (keep_slash and b == 0x2F):
            out.append(chr(b))
        else:
            out.append(f"%{b:02X}")
    return "".join(out)


def amz_date(now: Optional[float] = None) -> str:
    """``YYYYMMDDTHHMMSSZ`` (UTC)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))


def authorization(
    credentials: Credentials,
    method: str,
    canonical_uri: str,
    headers: Sequence[Tuple[str, str]],
    payload_sha256: str,
    amz_date: str,
    region: str,
    service: str = "s3",
    canonical_query: str = "",
) -> str:
    """The ``Authorization`` header for a request whose ``headers`` (lower-case
    names; ``host``, ``x-amz-date`` and ``x-amz-content-sha256`` among them)
    are all signed."""
    canonical = sorted((name, " ".join(value.split())) for name, value in headers)
    signed_headers = ";".join(name for name, _ in canonical)
    canonical_headers = "".join(f"{name}:{value}\n" for name, value in canonical)
    canonical_request = "\n".join(
        [method, canonical_uri, canonical_query, canonical_headers, signed_headers, payload_sha256]
    )
    date = amz_date[:8]
    scope = f"{date}/{region}/{service}/aws4_request"
    string_to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, sha256_hex(canonical_request.encode())])

    def mac(key: bytes, data: str) -> bytes:
        return hmac.new(key, data.encode(), hashlib.sha256).digest()

    key = mac(f"AWS4{credentials.secret_key}".encode(), date)
    for part in (region, service, "aws4_request"):
        key = mac(key, part)
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    return (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
        f"SignedHeaders={signed_headers}, Signature={signature}"
    )
