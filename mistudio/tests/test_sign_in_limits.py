"""Sign-in attempts are limited per account and per address: django-axes, with
the address counted as every other limit counts it (``mistudio.throttling.client_address``)."""

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def sign_in(username: str, password: str, *, address: str = "203.0.113.7", path: str = "/login/", **headers):
    client = Client(REMOTE_ADDR=address, **headers)
    return client.post(path, {"username": username, "password": password})


def fail(times: int, username: str, **kwargs) -> list[int]:
    """Statuses of ``times`` sign-ins with a wrong password (200: the form again, with its error)."""
    return [sign_in(username, "wrong-password", **kwargs).status_code for _ in range(times)]


def locked(response) -> bool:
    return (
        response.status_code == 429
        and int(response["Retry-After"]) == 15 * 60
        and "Too many failed sign-ins" in response.content.decode()
    )


def test_an_account_is_locked_after_ten_failures_from_any_addresses(writer):
    statuses = [fail(1, writer.username, address=f"198.51.100.{index}")[0] for index in range(10)]
    assert statuses == [200] * 9 + [429]  # the tenth failure is refused already
    # Even the right password, from a new address, waits out the lock-out.
    assert locked(sign_in(writer.username, "walt-writer-password", address="192.0.2.99"))


def test_an_address_is_locked_after_ten_failures_over_any_accounts(writer):
    for index in range(10):
        fail(1, f"guess-{index}", address="203.0.113.50")
    assert locked(sign_in(writer.username, "walt-writer-password", address="203.0.113.50"))
    # Another address is not affected, and a spoofed X-Forwarded-For does not make one.
    assert sign_in(writer.username, "walt-writer-password", address="203.0.113.51").status_code == 302
    spoofed = sign_in("guess-x", "wrong", address="203.0.113.50", HTTP_X_FORWARDED_FOR="192.0.2.1")
    assert locked(spoofed)


def test_nine_failures_and_then_the_right_password_signs_in_and_starts_afresh(writer):
    assert fail(9, writer.username) == [200] * 9
    response = sign_in(writer.username, "walt-writer-password")
    assert response.status_code == 302 and response["Location"] == "/"
    assert fail(9, writer.username) == [200] * 9  # the count started again at the success
    assert sign_in(writer.username, "walt-writer-password").status_code == 302


def test_the_admin_sign_in_is_limited_too(model_admin):
    for _ in range(10):
        sign_in(model_admin.username, "wrong", path="/admin/login/?next=/admin/")
    assert locked(sign_in(model_admin.username, "ada-admin-password", path="/admin/login/?next=/admin/"))
