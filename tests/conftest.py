"""Fixtures shared by every test folder: a throwaway PostgreSQL server.

``postgres_server``: one server for the whole test session (``initdb`` and
``pg_ctl`` in a temporary folder, run as an unprivileged user when the tests
run as root, since ``initdb`` refuses root; its socket in that folder, TCP on
a free port of 127.0.0.1), removed at the session's end. ``postgres_db``: a
fresh database on it per test, dropped afterwards. Without PostgreSQL's
binaries the tests that use them are skipped, except under ``CI=true``,
where they fail: ``.ci/run`` installs Debian's ``postgresql`` first.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import psycopg
import pytest

#: The user the test server runs as when the tests run as root.
_PG_USERS = ("postgres", "llmgw-test")


@attrs.frozen
class PostgresServer:
    """A running throwaway PostgreSQL server: superuser ``postgres``, no
    password (trust), TCP on 127.0.0.1:``port``."""

    port: int
    #: Runs ``pg_ctl`` on the server: ``"stop"`` (fast) or ``"start"``.
    pg_ctl: Callable[[str], None] | None = None

    def address(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def stop(self) -> None:
        """Stop the server (``pg_ctl stop -m fast``): connections are cut."""
        assert self.pg_ctl is not None
        self.pg_ctl("stop")

    def start(self) -> None:
        """Start the stopped server again, on the same port and data."""
        assert self.pg_ctl is not None
        self.pg_ctl("start")


def _postgres_bin() -> Path | None:
    """The folder with ``initdb`` and ``pg_ctl``: Debian's newest, else the PATH's."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    return None


def _server_user() -> pwd.struct_passwd | None:
    """As root, the unprivileged user to run the server as (made if none
    exists); ``None`` when the tests do not run as root."""
    if os.geteuid() != 0:
        return None
    for name in _PG_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _PG_USERS[-1]],
        check=True,
    )
    return pwd.getpwnam(_PG_USERS[-1])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole test session, removed at its end."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        message = (
            "PostgreSQL's initdb and pg_ctl were not found (install Debian's postgresql "
            "package: apt-get install -y postgresql)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must run the PostgreSQL store tests", pytrace=False)
        pytest.skip(message)
    user = _server_user()
    base = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    uid: int | None = None
    gid: int | None = None
    groups: list[int] | None = None
    if user is not None:
        os.chown(base, user.pw_uid, user.pw_gid)
        uid, gid, groups = user.pw_uid, user.pw_gid, []
    data = base / "data"
    log = base / "server.log"
    port = _free_port()
    env = {**os.environ, "LC_ALL": "C", "TZ": "UTC"}
    try:
        subprocess.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "--locale=C",
                "--encoding=UTF8",
            ],
            check=True,
            capture_output=True,
            cwd=base,
            env=env,
            user=uid,
            group=gid,
            extra_groups=groups,
        )
        options = (
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        started = subprocess.run(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(log),
                "-o",
                options,
                "-w",
                "start",
            ],
            capture_output=True,
            text=True,
            cwd=base,
            env=env,
            user=uid,
            group=gid,
            extra_groups=groups,
        )
        if started.returncode != 0:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            pytest.fail(
                f"the test PostgreSQL server did not start: {started.stderr}\n{server_log}",
                pytrace=False,
            )

        def pg_ctl(action: str) -> None:
            argv = [str(bin_dir / "pg_ctl"), "-D", str(data), "-w"]
            if action == "start":
                argv += ["-l", str(log), "-o", options, "start"]
            else:
                argv += ["-m", "fast", "stop"]
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                cwd=base,
                env=env,
                user=uid,
                group=gid,
                extra_groups=groups,
                check=False,
            )
            assert done.returncode == 0, f"pg_ctl {action}: {done.stderr}"

        try:
            yield PostgresServer(port=port, pg_ctl=pg_ctl)
        finally:
            subprocess.run(
                [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                capture_output=True,
                cwd=base,
                env=env,
                user=uid,
                group=gid,
                extra_groups=groups,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """The address of a fresh, empty database on the session's server,
    dropped after the test."""
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(server.address("postgres"), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield server.address(name)
    finally:
        with psycopg.connect(server.address("postgres"), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
