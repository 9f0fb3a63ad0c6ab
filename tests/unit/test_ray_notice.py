"""mrl.launch.cluster.init_ray keeps Ray's notice that token authentication is on by default (printed
at every start) out of the output, and nothing else: the warning that it is off still shows. Ray's
own functions emit the messages, so a Ray that renames its logger or rewords them fails here."""

import logging

import pytest

from mrl.launch.cluster import RAY_AUTH_LOGGER, _without_default_auth_notice


@pytest.fixture
def records():
    from ray._private.authentication import authentication_token_setup as setup

    assert setup.logger.name == RAY_AUTH_LOGGER
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    setup.logger.addHandler(handler)
    try:
        yield setup, seen
    finally:
        setup.logger.removeHandler(handler)


def test_the_default_on_notice_is_dropped_the_off_warning_kept(records):
    setup, seen = records
    with _without_default_auth_notice():
        setup._warn_token_auth_enabled()
        setup._warn_token_auth_disabled()
    assert len(seen) == 1 and seen[0].startswith("Token authentication is disabled")
    setup._warn_token_auth_enabled()  # outside init_ray Ray's logging is as it was
    assert seen[-1].startswith("Token authentication is enabled for this Ray cluster")
