"""Tokens never show in repr, str, formatting, exceptions or logs."""

import io
import logging
import pickle

import grpc
import pytest

from latchkey import Fenced, FenceReason, FencingToken, LockGuard
from latchkey._errors import refusal
from latchkey._holds import Hold

VALUE = 281_474_976_710_699  # epoch 1, revision 43


def test_repr_str_and_format_redact():
    token = FencingToken(VALUE)
    for shown in (repr(token), str(token), f"{token}", "%s" % token, "{}".format(token), f"{token!r:>40}"):
        assert str(VALUE) not in shown
        assert "redacted" in shown
    assert token.value == VALUE


@pytest.mark.parametrize(
    "convert",
    [int, hex, float, lambda t: "%d" % t, lambda t: "%i" % t, lambda t: "%5d" % t, lambda t: "%x" % t, lambda t: "%d" % (t,)],
)
def test_no_implicit_integer_way_out(convert):
    # `%d` goes through __int__: a token that converted would print itself
    # into any log line that asked for a number. token.value is the one way.
    with pytest.raises(TypeError):
        convert(FencingToken(VALUE))


def test_a_log_call_with_percent_d_prints_no_token(capsys):
    # What an application's own handler does with it: logging reports the
    # formatting error on stderr, with the arguments' repr.
    out = io.StringIO()
    logger = logging.getLogger("latchkey-test-percent-d")
    logger.propagate = False
    logger.addHandler(logging.StreamHandler(out))
    logger.warning("fenced with %d", FencingToken(VALUE))
    shown = out.getvalue() + capsys.readouterr().err
    assert "redacted" in shown, "the error names the argument, redacted"
    assert str(VALUE) not in shown


def test_tokens_compare_and_hash_by_value():
    assert FencingToken(1) < FencingToken(2)
    assert FencingToken(3) == FencingToken(3)
    assert len({FencingToken(3), FencingToken(3)}) == 1
    with pytest.raises(TypeError):
        pickle.dumps(FencingToken(3))
    with pytest.raises(ValueError):
        FencingToken(-1)


def test_a_guard_repr_shows_neither_the_token_nor_the_revision():
    hold = Hold("demo/x", 7, FencingToken(VALUE), 1, 43)
    hold.count = 1

    class _Session:
        id = 7
        is_fenced = False

    guard = LockGuard(hold, _Session(), 0, None)
    for shown in (repr(guard), str(guard), repr(hold)):
        assert str(VALUE) not in shown
        assert "43" not in shown
        assert "demo/x" in shown


def test_errors_and_log_records_carry_no_token(caplog):
    token = FencingToken(VALUE)
    caplog.set_level(logging.DEBUG, logger="latchkey")
    logging.getLogger("latchkey").warning("holding %s with %s", "demo/x", token)
    errors = [
        Fenced(7, FenceReason.HOLD_ENDED),
        refusal(grpc.StatusCode.FAILED_PRECONDITION, "NOT_HELD", "release of a key this session does not hold"),
    ]
    shown = caplog.text + "".join(str(e) + repr(e) for e in errors)
    assert str(VALUE) not in shown
