"""Join codes: what ``llmgw node add`` prints and ``llmgw join CODE`` reads.

A code is ``llmgw1.`` followed by the unpadded base64url of a compact JSON
object::

    {"a": ["10.0.0.1:7444", …], "t": "<one-time token>", "f": "sha256:<hex>"}

``a`` lists the control plane's join addresses (``host:port``, an IPv6 host
in brackets) in the order to try, ``t`` is the one-time token, ``f`` the
fingerprint of the cluster CA (SHA-256 of its DER). See ``docs/cluster.md``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable
from typing import Final

import attrs

from llmgw import errors

__all__ = ["PREFIX", "JoinCode", "JoinCodeError", "host_port", "join_address"]

#: What every join code of this format starts with.
PREFIX: Final = "llmgw1."
#: The longest code :meth:`JoinCode.decode` reads, in characters.
MAX_CODE_CHARS: Final = 8192

_FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")
_OTHER_VERSION = re.compile(r"^llmgw(\d+)\.")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")
_AGAIN = "copy the whole `llmgw join …` line again, or make a new code with `llmgw node add`"


class JoinCodeError(errors.InvalidInput):
    """A join code that cannot be read; the message says what is wrong."""


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class JoinCode:
    """What a join code carries.

    Attributes:
        addresses: the control plane's join addresses, ``host:port`` each.
        token: the one-time token.
        fingerprint: ``"sha256:"`` + the hex SHA-256 of the CA certificate's DER.
    """

    addresses: tuple[str, ...] = attrs.field(converter=_str_tuple)
    token: str
    fingerprint: str

    def encode(self) -> str:
        """The code as text: ``llmgw1.`` + base64url (no padding) of the JSON."""
        doc = {"a": list(self.addresses), "t": self.token, "f": self.fingerprint}
        raw = json.dumps(doc, separators=(",", ":")).encode()
        return PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")

    @classmethod
    def decode(cls, text: str) -> JoinCode:
        """Read a code; white space anywhere in it (a wrapped line) is ignored.

        Raises:
            JoinCodeError: ``text`` is not a join code, is of another version,
                or is damaged (cut short, altered, a field missing).
        """
        code = "".join(text.split())
        if code.startswith("llmgwjoin"):  # the whole line `llmgw join CODE` pasted
            code = code[len("llmgwjoin") :]
        if not code.startswith(PREFIX):
            other = _OTHER_VERSION.match(code)
            if other:
                raise JoinCodeError(
                    f"this join code is of format llmgw{other.group(1)}, which this llmgw does "
                    f"not read (it reads {PREFIX[:-1]}): use the same llmgw version as the "
                    "control plane"
                )
            raise JoinCodeError(
                f"this is not a join code: a join code starts with {PREFIX!r}; "
                "`llmgw node add` on the control plane prints one"
            )
        if len(code) > MAX_CODE_CHARS:
            raise JoinCodeError(
                f"this join code is {len(code)} characters long, more than any join code "
                f"({MAX_CODE_CHARS}): {_AGAIN}"
            )
        body = code[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            doc = json.loads(raw)
        except (binascii.Error, ValueError) as exc:
            raise JoinCodeError(
                f"this join code is damaged (it does not decode: {exc}): {_AGAIN}"
            ) from None
        return cls._from_doc(doc)

    @classmethod
    def _from_doc(cls, doc: object) -> JoinCode:
        if not isinstance(doc, dict):
            raise JoinCodeError(f"this join code is damaged (not an object): {_AGAIN}")
        addresses, token, fingerprint = doc.get("a"), doc.get("t"), doc.get("f")
        if (
            not isinstance(addresses, list)
            or not addresses
            or not all(isinstance(a, str) and _valid_address(a) for a in addresses)
        ):
            raise JoinCodeError(
                f"this join code is damaged (no valid control plane address in it): {_AGAIN}"
            )
        if not isinstance(token, str) or not token:
            raise JoinCodeError(f"this join code is damaged (no token in it): {_AGAIN}")
        if not isinstance(fingerprint, str) or not _FINGERPRINT.match(fingerprint):
            raise JoinCodeError(
                f"this join code is damaged (no valid CA fingerprint in it): {_AGAIN}"
            )
        return cls(tuple(addresses), token, fingerprint)


def _valid_address(address: str) -> bool:
    match = _ADDRESS.match(address)
    return match is not None and 1 <= int(match.group(2)) <= 65535


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of a join address; an IPv6 host loses its brackets.

    Raises:
        JoinCodeError: ``address`` is not ``host:port``.
    """
    match = _ADDRESS.match(address)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise JoinCodeError(f"{address!r} is not HOST:PORT")
    return match.group(1).strip("[]"), int(match.group(2))


def join_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
