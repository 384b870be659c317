"""gRPC statuses map to exceptions by ErrorInfo reason first, code second."""

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

import latchkey
from latchkey._errors import _reason_from_details, refusal


def details(reason: str, domain: str = "latchkey.dev") -> bytes:
    status = status_pb2.Status(code=9, message="m")
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain))
    return status.SerializeToString()


def test_the_reason_comes_from_error_info_in_our_domain():
    assert _reason_from_details(details("NOT_HELD")) == "NOT_HELD"
    assert _reason_from_details(details("NOT_HELD", "example.com")) == ""
    assert _reason_from_details(b"\xff\xff not a status") == ""


@pytest.mark.parametrize(
    "code, reason, cls, base",
    [
        (grpc.StatusCode.FAILED_PRECONDITION, "NOT_HELD", latchkey.NotHeld, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "TOKEN_MISMATCH", latchkey.NotHeld, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "LEAK", latchkey.Leak, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "SEALED", latchkey.Sealed, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "NOT_LEADER", latchkey.NotLeader, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "NO_CANDIDATE", latchkey.NoCandidate, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "QUOTA_EXCEEDED", latchkey.QuotaExceeded, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "KIND_IN_USE", latchkey.KindInUse, latchkey.FailedPrecondition),
        (grpc.StatusCode.FAILED_PRECONDITION, "UPGRADE_REFUSED", latchkey.UpgradeRefused, latchkey.FailedPrecondition),
        (grpc.StatusCode.INVALID_ARGUMENT, "WRONG_KIND", latchkey.WrongKind, latchkey.InvalidArgument),
        (grpc.StatusCode.ABORTED, "HELD", latchkey.Held, latchkey.Aborted),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "WAIT_TIMEOUT", latchkey.WaitTimeout, latchkey.DeadlineExceeded),
        (grpc.StatusCode.PERMISSION_DENIED, "NOT_AUTHORISED", latchkey.PermissionDenied, latchkey.Refused),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL", latchkey.ResourceExhausted, latchkey.Refused),
        (grpc.StatusCode.UNAVAILABLE, "POLICY_NOT_READY", latchkey.Unavailable, latchkey.Refused),
        (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", latchkey.Unauthenticated, latchkey.Refused),
        (grpc.StatusCode.INVALID_ARGUMENT, "BAD_KEY", latchkey.InvalidArgument, latchkey.Refused),
        # a reason under an unexpected code keeps the code's class
        (grpc.StatusCode.PERMISSION_DENIED, "NOT_HELD", latchkey.PermissionDenied, latchkey.Refused),
        (grpc.StatusCode.INTERNAL, "", latchkey.Refused, latchkey.LatchkeyError),
    ],
)
def test_refusals_map_to_exceptions(code, reason, cls, base):
    error = refusal(code, reason, "message")
    assert type(error) is cls
    assert isinstance(error, base)
    assert error.code == code and error.reason == reason
    assert code.name in str(error)


def test_transient_refusals():
    assert refusal(grpc.StatusCode.UNAVAILABLE, "", "").is_transient()
    assert refusal(grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE", "").is_transient()
    assert refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "", "").is_transient()
    assert not refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "WAIT_TIMEOUT", "").is_transient()
    assert not refusal(grpc.StatusCode.PERMISSION_DENIED, "NOT_AUTHORISED", "").is_transient()
    assert not latchkey.Fenced(1, latchkey.FenceReason.EXPIRED).is_transient()


def test_a_plain_http_endpoint_is_refused_before_any_file_is_read():
    with pytest.raises(latchkey.ConfigError, match="mTLS only"):
        latchkey.Client("http://127.0.0.1:1", ca="/nonexistent", cert="/nonexistent", key="/nonexistent")


def test_a_missing_svid_file_names_it():
    with pytest.raises(latchkey.ConfigError, match="CA bundle /nonexistent/ca.pem"):
        latchkey.Client("127.0.0.1:1", ca="/nonexistent/ca.pem", cert="/x", key="/y")
