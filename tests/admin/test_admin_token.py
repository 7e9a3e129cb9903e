"""The admin token: the only thing that opens the admin API; a client key
does not, and /v1's key check refuses the token."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from llmgw.auth.admin_token import (
    ADMIN_TOKEN_FILE,
    ADMIN_TOKEN_PREFIX,
    AdminTokenFile,
    AdminTokenMissing,
    is_admin_token,
    new_admin_token,
    read_admin_token,
    write_admin_token,
)
from llmgw.auth.keys import KeyAuthenticator, KeyRefused, new_key

if TYPE_CHECKING:
    from tests.admin.conftest import Admin


def test_a_token_is_written_0600_read_back_and_is_not_a_client_key(tmp_path: Path) -> None:
    token = new_admin_token()
    assert token.startswith(ADMIN_TOKEN_PREFIX)
    assert not token.startswith("sk-llmgw-")
    assert is_admin_token(token)
    assert new_admin_token() != token
    path = tmp_path / ADMIN_TOKEN_FILE
    write_admin_token(path, token)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_admin_token(path) == token
    assert sorted(p.name for p in tmp_path.iterdir()) == [ADMIN_TOKEN_FILE]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "no admin token at"),
        ("sk-llmgw-abcdefghijklmnopqrstuvwxyz\n", "holds no admin token"),
    ],
)
def test_reading_a_missing_or_wrong_file_says_what_to_run(
    tmp_path: Path, content: str | None, says: str
) -> None:
    path = tmp_path / ADMIN_TOKEN_FILE
    if content is not None:
        path.write_text(content)
    with pytest.raises(AdminTokenMissing, match=says):
        read_admin_token(path)


def test_the_file_is_checked_anew_so_a_rotation_refuses_the_old_token_at_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / ADMIN_TOKEN_FILE
    old, new = new_admin_token(), new_admin_token()
    write_admin_token(path, old)
    check = AdminTokenFile(path)
    assert check.check(old)
    assert not check.check(new)
    assert not check.check("")
    write_admin_token(path, new)
    assert check.check(new)
    assert not check.check(old)
    path.unlink()
    assert not check.check(new)
    assert not AdminTokenFile(None).check(new)


def test_a_token_rewritten_in_place_is_seen_too(tmp_path: Path) -> None:
    """Even a hand edit that keeps the inode (same size, maybe the same mtime
    tick) changes the ctime, which the check looks at."""
    path = tmp_path / ADMIN_TOKEN_FILE
    old, new = new_admin_token(), new_admin_token()
    path.write_text(old + "\n")
    check = AdminTokenFile(path)
    assert check.check(old)
    status = path.stat()
    path.write_text(new + "\n")
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert check.check(new)
    assert not check.check(old)


async def test_v1_s_key_check_refuses_the_admin_token_saying_what_it_is(admin: Admin) -> None:
    with pytest.raises(KeyRefused, match="admin token: it opens the admin API only") as caught:
        await KeyAuthenticator(admin.store).check(admin.secret)
    assert caught.value.status == 401


async def test_a_live_client_key_does_not_open_the_admin_api(admin: Admin) -> None:
    secret, record = new_key("a client")
    await admin.store.insert_key(record)
    assert await KeyAuthenticator(admin.store).check(secret) == record
    status, body = await admin.call("GET", "/api/v1/keys", key=secret)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["message"].startswith("This is a client key (sk-llmgw-…)")
    assert "DATA_DIR/admin-token" in body["error"]["message"]


async def test_the_admin_api_follows_the_file(admin: Admin) -> None:
    assert (await admin.call("GET", "/api/v1/keys"))[0] == 200
    old, admin.secret = admin.secret, new_admin_token()
    write_admin_token(admin.data_dir / ADMIN_TOKEN_FILE, admin.secret)
    status, body = await admin.call("GET", "/api/v1/keys", key=old)
    assert (status, body["error"]["message"]) == (401, "Incorrect admin token provided.")
    assert (await admin.call("GET", "/api/v1/keys"))[0] == 200
