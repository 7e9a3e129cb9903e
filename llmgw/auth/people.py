"""People: accounts, passwords, staff roles, memberships and sessions
(``docs/portal.md``).

- Passwords are hashed with argon2id (``argon2-cffi``'s defaults: 64 MiB,
  3 passes); a stored hash that begins with ``!`` is no local password.
- Sign-in failures are counted per (address, client) pair and per client, in
  this process: :data:`PAIR_FAILURES` (5) wrong passwords from one client
  lock that client out of that account (and, past :data:`CLIENT_FAILURES`, out of every account) for
  :data:`LOCKOUT_S`, never the owner signing in from elsewhere. A client's
  counters reset when it signs in.
- An unknown address is checked against a dummy hash, so it costs the same
  time as a known one with a wrong password.
- A session is a random token in a cookie; the store keeps its SHA-256 only.
  Its CSRF token is an HMAC of the session token under the store's
  ``portal-sessions`` secret, so nothing more is stored and every control
  plane of one store agrees.
- A password change, a suspension, a deletion or ``forget`` ends the
  person's sessions at once, and revokes the keys their sessions made for
  the chat page.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Sequence
from typing import Final, Literal, cast, get_args

import argon2
import attrs
import trio

from llmgw import errors
from llmgw.store import Conflict, KeyRecord, Membership, Person, SessionRecord, Store
from llmgw.store.records import MemberRole, PersonState, StaffRole

from .keys import KEY_PREFIX, KeyAuthenticator, hash_key

__all__ = [
    "CHAT_KEY_NAME",
    "MEMBER_ROLES",
    "STAFF_ROLES",
    "AccountRefused",
    "Failures",
    "People",
    "SignInRefused",
    "TooManyAttempts",
    "hash_password",
]

STAFF_ROLES: Final = ("viewer", "operator", "billing", "admin")
MEMBER_ROLES: Final = ("member", "manager")
STATES: Final = get_args(PersonState)
#: A session's life (s).
SESSION_TTL_S: Final = 12 * 3600.0
#: Failures of one client against one address before that pair is locked.
PAIR_FAILURES: Final = 5
#: Failures of one client against any address before that client is locked.
CLIENT_FAILURES: Final = 20
#: How long failures are remembered and a lock lasts (s).
LOCKOUT_S: Final = 15 * 60.0
#: The name of the key a session makes for the chat page.
CHAT_KEY_NAME: Final = "portal chat"
_EMAIL = re.compile(r"^[^@\s]{1,64}@[^@\s]{1,190}$")
_NOT_IN_PATH = re.compile(r"[/\\\x00-\x1f\x7f]")
_HASHER: Final = argon2.PasswordHasher()
#: Argon2 runs in worker threads, at most this many at once.
_HASH_LIMITER: Final = trio.CapacityLimiter(2)


class SignInRefused(errors.Refused):
    """Wrong address or password (one message for both)."""

    status = 401
    code = "sign_in_refused"


class TooManyAttempts(errors.Refused):
    """Too many failed sign-ins from this client (for this address)."""

    status = 429
    code = "too_many_attempts"


class AccountRefused(errors.Refused):
    """The account exists and the password is right, but it may not sign in."""

    status = 403
    code = "account_not_active"


def hash_password(password: str) -> str:
    """An argon2id PHC string for ``password`` (blocking: ~0.1 s, 64 MiB)."""
    return _HASHER.hash(password)


def _verify(stored: str, password: str) -> bool:
    try:
        return _HASHER.verify(stored, password)
    except (argon2.exceptions.VerificationError, argon2.exceptions.InvalidHashError):
        return False


def check_email(email: object) -> str:
    """The address lower-cased. Raises InvalidInput when it is not one."""
    if not isinstance(email, str) or not _EMAIL.match(email.strip()):
        raise errors.InvalidInput("'email' must be a sign-in address like ada@example.com")
    if _NOT_IN_PATH.search(email.strip()):
        # The address is a segment of the admin API's paths (/api/v1/people/WHO):
        # a '/' (even quoted) or a control character cannot sit in one.
        raise errors.InvalidInput(
            "'email' cannot hold '/', '\\' or control characters (it names the "
            "account in the admin API's paths)"
        )
    return email.strip().lower()


def check_password(password: object) -> str:
    """Raises InvalidInput for a password shorter than 10 or longer than 1000."""
    if not isinstance(password, str) or not 10 <= len(password) <= 1000:
        raise errors.InvalidInput("a password is 10 to 1000 characters")
    return password


@attrs.define
class Failures:
    """Failed sign-ins per (address, client) pair and per client, with times
    (monotonic s); entries older than :data:`LOCKOUT_S` are dropped."""

    pairs: dict[tuple[str, str], list[float]] = attrs.field(factory=dict)
    clients: dict[str, list[float]] = attrs.field(factory=dict)

    def _recent(self, times: list[float], now: float) -> list[float]:
        return [t for t in times if now - t < LOCKOUT_S]

    def locked(self, email: str, client: str, now: float) -> bool:
        pair = self._recent(self.pairs.get((email, client), []), now)
        mine = self._recent(self.clients.get(client, []), now)
        return len(pair) >= PAIR_FAILURES or len(mine) >= CLIENT_FAILURES

    def fail(self, email: str, client: str, now: float) -> None:
        if len(self.pairs) > 100_000:
            self.pairs.clear()
            self.clients.clear()
        key = (email, client)
        self.pairs[key] = [*self._recent(self.pairs.get(key, []), now), now]
        self.clients[client] = [*self._recent(self.clients.get(client, []), now), now]

    def reserve(self, email: str, client: str, now: float) -> bool:
        """Check and count one attempt at once (no await between): ``False``
        when the pair or client is locked, else the attempt is counted as a
        failure until :meth:`succeed` or :meth:`release` undoes it, so
        concurrent attempts cannot all pass the check before any counts."""
        if self.locked(email, client, now):
            return False
        self.fail(email, client, now)
        return True

    def release(self, email: str, client: str, at: float) -> None:
        """Undo one attempt :meth:`reserve` counted at ``at`` (it did not
        end in a verdict, e.g. a store error or cancellation)."""
        for times in (self.pairs.get((email, client)), self.clients.get(client)):
            if times is not None and at in times:
                times.remove(at)

    def succeed(self, email: str, client: str) -> None:
        self.pairs.pop((email, client), None)
        self.clients.pop(client, None)


@attrs.frozen
class SignedIn:
    """A live session: its person and record."""

    person: Person
    session: SessionRecord


class People:
    """Accounts and sessions over ``store``.

    Args:
        secret: the HMAC key for CSRF tokens and chat keys (the store's
            ``portal-sessions`` secret).
        authenticator: told to forget keys revoked here.
    """

    def __init__(
        self,
        store: Store,
        secret: bytes,
        authenticator: KeyAuthenticator | None = None,
        *,
        session_ttl_s: float = SESSION_TTL_S,
    ) -> None:
        self._store = store
        self._secret = secret
        self._auth = authenticator
        self.session_ttl_s = session_ttl_s
        self.failures = Failures()
        #: What an unknown address is checked against (made on first need,
        #: in a worker thread, with the same parameters as real hashes).
        self._dummy = ""

    # --- accounts --------------------------------------------------------
    async def join(
        self,
        email: object,
        *,
        name: str = "",
        password: str | None = None,
        staff_role: str = "",
        state: str = "active",
    ) -> tuple[Person, str]:
        """Make an account; returns it and its password (made up when
        ``password`` is ``None``, to be shown once).

        Raises:
            InvalidInput: a bad address, password, role or state.
            Refused: (409 ``person_exists``) the address is taken.
        """
        address = check_email(email)
        if staff_role not in ("", *STAFF_ROLES):
            raise errors.InvalidInput(
                f"unknown staff role {staff_role!r}; known: {', '.join(STAFF_ROLES)}"
            )
        if state not in STATES:
            raise errors.InvalidInput(f"unknown state {state!r}; known: {', '.join(STATES)}")
        if password is None:
            password = secrets.token_urlsafe(15)
        check_password(password)
        person = Person(
            id="person_" + secrets.token_hex(8),
            email=address,
            name=name[:200],
            password_hash=await self._hash(password),
            state=cast(PersonState, state),
            staff_role=cast(StaffRole, staff_role),
            created_at=time.time(),
        )
        try:
            await self._store.insert_person(person)
        except Conflict:
            raise _Exists(f"{address} already has an account") from None
        return person, password

    async def find(self, who: str) -> Person:
        """The person with this id or address. Raises NotFound."""
        person = await (
            self._store.get_person(who)
            if who.startswith("person_")
            else self._store.find_person(who)
        )
        if person is None:
            raise errors.NotFound(f"no person {who!r}")
        return person

    async def _keep_an_admin(self, person: Person, action: str) -> None:
        """Raises LastAdmin when ``person`` is the only active admin."""
        if person.staff_role != "admin" or person.state != "active":
            return
        if any(
            p.id != person.id and p.staff_role == "admin" and p.state == "active"
            for p in await self._store.list_people()
        ):
            return
        raise LastAdmin(
            f"{person.email} is the last admin: cannot {action} them; make another "
            "person admin first"
        )

    async def set_role(self, who: str, role: str) -> Person:
        """Set the staff role ("" = none). Raises InvalidInput, NotFound,
        LastAdmin (409: the last active admin would lose the role)."""
        if role not in ("", *STAFF_ROLES):
            raise errors.InvalidInput(
                f"unknown staff role {role!r}; known: {', '.join(STAFF_ROLES)}"
            )
        found = await self.find(who)
        if role != "admin":
            await self._keep_an_admin(found, "take the admin role from")
        person = attrs.evolve(found, staff_role=cast(StaffRole, role))
        await self._store.update_person(person)
        return person

    async def approve(self, who: str) -> Person:
        """An awaiting account made active (an active one stays so).

        Raises:
            NotFound: no such person.
            WrongState: (409) the account is suspended: ``reinstate`` it.
        """
        person = await self.find(who)
        if person.state == "suspended":
            raise WrongState(f"{person.email} is suspended, not awaiting approval: use reinstate")
        return await self.set_state(person.id, "active")

    async def set_state(self, who: str, state: str) -> Person:
        """approve/reinstate (``active``) or suspend; a suspension ends the
        person's sessions at once. Raises InvalidInput, NotFound, LastAdmin
        (409: the last active admin would be suspended)."""
        if state not in STATES:
            raise errors.InvalidInput(f"unknown state {state!r}; known: {', '.join(STATES)}")
        found = await self.find(who)
        if state != "active":
            await self._keep_an_admin(found, "suspend")
        person = attrs.evolve(found, state=cast(PersonState, state))
        await self._store.update_person(person)
        if state != "active":
            await self.end_sessions(person)
        return person

    async def set_password(self, who: str, password: object) -> Person:
        """Set a new password; ends every session of the person."""
        new = check_password(password)
        person = await self.find(who)
        person = attrs.evolve(person, password_hash=await self._hash(new))
        await self._store.update_person(person)
        await self.end_sessions(person)
        return person

    async def delete(self, who: str) -> Person:
        """Delete the account (sessions and memberships go; keys stay).
        Raises NotFound, LastAdmin (409)."""
        person = await self.find(who)
        await self._keep_an_admin(person, "delete")
        await self.end_sessions(person)
        await self._store.delete_person(person.id)
        return person

    async def forget(self, who: str) -> str:
        """Erase the person's data; their keys (revoked) and usage stay under
        an anonymous id, which is returned. Raises NotFound, LastAdmin (409)."""
        person = await self.find(who)
        await self._keep_an_admin(person, "forget")
        await self.end_sessions(person)
        anonymous = "forgotten-" + hashlib.sha256(secrets.token_bytes(16)).hexdigest()[:12]
        owned = [k.id for k in await self._store.list_keys() if k.owner == person.email]
        await self._store.forget_person(person.id, anonymous, time.time())
        for key_id in owned:
            if self._auth is not None:
                self._auth.forget(key_id)
        return anonymous

    async def add_membership(self, who: str, scope: str, scope_id: str, role: str) -> Membership:
        if scope not in ("org", "team", "project"):
            raise errors.InvalidInput("'scope' is org, team or project")
        if role not in MEMBER_ROLES:
            raise errors.InvalidInput(f"unknown role {role!r}; known: member, manager")
        person = await self.find(who)
        membership = Membership(
            person_id=person.id,
            scope=cast(Literal["org", "team", "project"], scope),
            scope_id=scope_id,
            role=cast(MemberRole, role),
        )
        await self._store.put_membership(membership)
        return membership

    async def sign_up(self, email: object, password: object) -> None:
        """Ask for an account: made awaiting approval. An address already
        taken changes nothing and says nothing (no enumeration).

        Raises:
            InvalidInput: a bad address or password.
        """
        checked = check_password(password)
        try:
            await self.join(email, password=checked, state="awaiting")
        except _Exists:
            pass

    async def ensure_first_admin(self, email: str, password: str | None) -> str | None:
        """On a store with nobody in it, make ``email`` an active admin.

        Returns:
            The password made up for it (to print once), ``""`` when
            ``password`` was given, ``None`` when people existed already.
        """
        if await self._store.list_people():
            return None
        try:
            _, made = await self.join(email, password=password, staff_role="admin", name="admin")
        except _Exists:
            return None
        return made if password is None else ""

    # --- sessions --------------------------------------------------------
    async def sign_in(
        self, email: str, password: str, client: str, *, ttl_s: float | None = None
    ) -> tuple[Person, str]:
        """Check the password; a new session's token, valid ``ttl_s``
        (default: the ``session_ttl_s`` given at construction).

        Raises:
            TooManyAttempts: this client failed too often (for this address).
            SignInRefused: unknown address or wrong password (same message,
                same time: an unknown address is checked against a dummy).
            AccountRefused: awaiting approval or suspended.
        """
        address = email.strip().lower()
        now = trio.current_time()
        if not self.failures.reserve(address, client, now):
            raise TooManyAttempts(
                "Too many failed sign-ins from this address; try again in 15 minutes."
            )
        # The attempt counts as failed from here until the verdict, so at most
        # PAIR_FAILURES / CLIENT_FAILURES verifications run however many arrive.
        try:
            if not self._dummy:
                self._dummy = await self._hash(secrets.token_urlsafe(16))
            person = await self._store.find_person(address)
            stored = person.password_hash if person is not None else "!"
            usable = not stored.startswith("!")
            ok = await self._verify(stored if usable else self._dummy, password) and usable
        except BaseException:
            self.failures.release(address, client, now)
            raise
        if person is None or not ok:
            raise SignInRefused("Wrong address or password.")
        self.failures.succeed(address, client)
        if person.state != "active":
            why = "awaits approval" if person.state == "awaiting" else "is suspended"
            raise AccountRefused(f"This account {why}.")
        token = secrets.token_urlsafe(32)
        at = time.time()
        await self._store.insert_session(
            SessionRecord(
                token_hash=_sha(token),
                person_id=person.id,
                created_at=at,
                expires_at=at + (self.session_ttl_s if ttl_s is None else ttl_s),
                client=client[:100],
            )
        )
        return person, token

    async def session(self, token: str) -> SignedIn | None:
        """The live session of ``token``: unexpired, its person active."""
        if not token or len(token) > 200:
            return None
        record = await self._store.get_session(_sha(token))
        if record is None or record.expires_at <= time.time():
            return None
        person = await self._store.get_person(record.person_id)
        if person is None or person.state != "active":
            return None
        return SignedIn(person, record)

    async def sign_out(self, token: str, person: Person | None = None) -> None:
        """End one session and revoke its chat key."""
        await self._store.delete_session(_sha(token))
        key = await self._store.find_key_by_hash(hash_key(self.chat_key(token)))
        if key is not None:
            await self._revoke([key])

    async def end_sessions(self, person: Person) -> int:
        """End every session of ``person`` and revoke their chat keys."""
        ended = await self._store.delete_sessions(person.id, before=time.time())
        chat = [
            k
            for k in await self._store.list_keys()
            if k.owner == person.email and k.name == CHAT_KEY_NAME and k.revoked_at is None
        ]
        await self._revoke(chat)
        return ended

    async def _revoke(self, keys: Sequence[KeyRecord]) -> None:
        at = time.time()
        for key in keys:
            await self._store.revoke_key(key.id, at)
            if self._auth is not None:
                self._auth.forget(key.id)

    def csrf_token(self, token: str) -> str:
        """The CSRF token of the session ``token``."""
        return _mac(self._secret, "csrf:" + token)

    def check_csrf(self, token: str, presented: str) -> bool:
        return hmac.compare_digest(self.csrf_token(token), presented or "")

    def chat_key(self, token: str) -> str:
        """The client key the chat page of session ``token`` uses (derived,
        never stored; only its hash is)."""
        return KEY_PREFIX + _mac(self._secret, "chat:" + token)

    async def ensure_chat_key(
        self, signed: SignedIn, token: str, project_id: str | None = None
    ) -> tuple[str, KeyRecord]:
        """The session's chat key (its secret and record), made on first
        need: a key of the person expiring with the session, in
        ``project_id`` (a project the person is a member of, so the chat
        obeys that project's, team's and org's limits and model lists) or
        personal when ``None``. A key already made keeps its place."""
        secret = self.chat_key(token)
        found = await self._store.find_key_by_hash(hash_key(secret))
        if found is not None:
            return secret, found
        record = KeyRecord(
            id="key_" + secrets.token_hex(8),
            name=CHAT_KEY_NAME,
            key_hash=hash_key(secret),
            prefix=secret[: len(KEY_PREFIX) + 4],
            created_at=time.time(),
            expires_at=signed.session.expires_at,
            owner=signed.person.email,
            project_id=project_id,
        )
        try:
            await self._store.insert_key(record)
        except Conflict:
            found = await self._store.find_key_by_hash(hash_key(secret))
            if found is not None:
                return secret, found
        return secret, record

    async def _hash(self, password: str) -> str:
        return await trio.to_thread.run_sync(hash_password, password, limiter=_HASH_LIMITER)

    async def _verify(self, stored: str, password: str) -> bool:
        return await trio.to_thread.run_sync(_verify, stored, password, limiter=_HASH_LIMITER)


class _Exists(errors.Refused):
    status = 409
    code = "person_exists"


class LastAdmin(errors.Refused):
    """The change would leave no active admin."""

    status = 409
    code = "last_admin"


class WrongState(errors.Refused):
    """The action does not fit the account's state (approve a suspended one)."""

    status = 409
    code = "wrong_state"


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _mac(secret: bytes, text: str) -> str:
    digest = hmac.new(secret, text.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")
