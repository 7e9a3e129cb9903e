"""The built-in pattern rules: what each kind looks like, and the checks a
candidate must pass before it counts (Luhn for cards, mod 97 for IBANs).

Patterns are written for hyperscan (no look-arounds, no back-references);
what they cannot say is said by a check over the matched bytes and their
neighbours. ``docs/guardrails.md`` lists the kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import attrs

__all__ = [
    "INJECTION",
    "PII",
    "SECRETS",
    "Kind",
    "iban_ok",
    "luhn_ok",
]

#: A check over ``data[start:end]`` (it may look at the neighbours).
Check = Callable[[bytes, int, int], bool]


@attrs.frozen
class Kind:
    """One pattern kind.

    Attributes:
        rule: the rule id recorded (``pii:email``, ``secret:aws_access_key``).
        label: the placeholder's word (``EMAIL`` → ``[EMAIL_1]``).
        pattern: the hyperscan expression, bytes.
        caseless: matched without regard to case.
        check: a further check of a candidate, or None.
    """

    rule: str
    label: str
    pattern: bytes
    caseless: bool = False
    check: Check | None = None


def _digits(data: bytes) -> list[int]:
    return [c - 48 for c in data if 48 <= c <= 57]


def luhn_ok(data: bytes) -> bool:
    """Whether the digits in ``data`` (13 to 19 of them) pass the Luhn check."""
    digits = _digits(data)
    if not 13 <= len(digits) <= 19 or len(set(digits)) == 1:
        return False
    total = 0
    for at, digit in enumerate(reversed(digits)):
        if at % 2:
            digit *= 2
            if digit > 9:
                digit -= 9
        total += digit
    return total % 10 == 0


def iban_ok(data: bytes) -> bool:
    """Whether ``data`` (spaces allowed) is an IBAN whose check digits hold (ISO 13616)."""
    text = data.replace(b" ", b"").decode("ascii", "replace").upper()
    if not 15 <= len(text) <= 34:
        return False
    moved = text[4:] + text[:4]
    try:
        number = int("".join(str(int(c, 36)) for c in moved))
    except ValueError:
        return False
    return number % 97 == 1


def _alone(data: bytes, start: int, end: int) -> bool:
    """No digit, dot, dash or letter right before or after: not part of a longer number or word."""
    before = data[start - 1 : start]
    after = data[end : end + 1]
    return not (
        (before and (before.isalnum() or before in b".-_/"))
        or (after and (after.isalnum() or after in b"-_/"))
        or (after == b"." and data[end + 1 : end + 2].isdigit())
    )


def _card(data: bytes, start: int, end: int) -> bool:
    chunk = data[start:end]
    separators = {c for c in chunk if c in b" -"}
    return len(separators) <= 1 and _alone(data, start, end) and luhn_ok(chunk)


def _iban(data: bytes, start: int, end: int) -> bool:
    return _alone(data, start, end) and iban_ok(data[start:end])


def _phone(data: bytes, start: int, end: int) -> bool:
    return _alone(data, start, end) and 9 <= len(_digits(data[start:end])) <= 15


def _ssn(data: bytes, start: int, end: int) -> bool:
    if not _alone(data, start, end):
        return False
    area, group, serial = data[start:end].split(b"-")
    return (
        area not in (b"000", b"666") and area[:1] != b"9" and group != b"00" and serial != b"0000"
    )


def _ip(data: bytes, start: int, end: int) -> bool:
    return _alone(data, start, end) and all(
        int(part) <= 255 for part in data[start:end].split(b".")
    )


#: Secrets: cloud keys, the common providers' tokens, private key blocks,
#: JWTs, connection strings with a password. The more specific first (a
#: tie on the same span goes to the earlier kind).
SECRETS: Final = (
    Kind("secret:aws_access_key", "AWS_KEY", rb"\b(?:AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}\b"),
    Kind(
        "secret:aws_secret_key",
        "AWS_SECRET",
        rb"aws_?secret_?access_?key\W{0,4}[A-Za-z0-9/+=]{40}",
        caseless=True,
    ),
    Kind(
        "secret:github_token",
        "GITHUB_TOKEN",
        rb"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{60,})",
    ),
    Kind("secret:gitlab_token", "GITLAB_TOKEN", rb"\bglpat-[A-Za-z0-9_-]{20,}"),
    Kind("secret:anthropic_key", "ANTHROPIC_KEY", rb"\bsk-ant-[A-Za-z0-9_-]{20,}"),
    Kind("secret:openai_key", "OPENAI_KEY", rb"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),
    Kind("secret:slack_token", "SLACK_TOKEN", rb"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    Kind("secret:google_api_key", "GOOGLE_KEY", rb"\bAIza[0-9A-Za-z_-]{35}"),
    Kind("secret:stripe_key", "STRIPE_KEY", rb"\b(?:sk|rk)_live_[0-9A-Za-z]{16,}"),
    Kind("secret:huggingface_token", "HF_TOKEN", rb"\bhf_[A-Za-z0-9]{30,}"),
    Kind(
        "secret:private_key",
        "PRIVATE_KEY",
        rb"-----BEGIN [A-Z ]{0,24}PRIVATE KEY( BLOCK)?-----(?:[A-Za-z0-9+/=\s:,-]+-----END [A-Z ]{0,24}PRIVATE KEY( BLOCK)?-----)?",
    ),
    Kind("secret:jwt", "JWT", rb"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    Kind(
        "secret:connection_string",
        "CONNECTION_STRING",
        rb"\b[A-Za-z][A-Za-z0-9+.-]{1,20}://[^\s:/@]{1,64}:[^\s:/@]{1,128}@[A-Za-z0-9.-]+",
    ),
)

#: PII kinds (``GUARD_PII_KINDS`` of the settings), by kind.
PII: Final = {
    "email": Kind(
        "pii:email",
        "EMAIL",
        rb"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}\b",
    ),
    "card": Kind("pii:card", "CARD", rb"\b\d(?:[ -]?\d){12,18}\b", check=_card),
    "iban": Kind(
        "pii:iban",
        "IBAN",
        rb"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b",
        check=_iban,
    ),
    "phone": Kind(
        "pii:phone",
        "PHONE",
        rb"(?:\+\d{1,3}[ -]?(?:\(\d{1,4}\)[ -]?)?\d{1,4}(?:[ -]?\d{2,4}){2,4}|(?:\(\d{3}\) ?|\b\d{3}[ -])\d{3}[ -]\d{4})\b",
        check=_phone,
    ),
    "ssn": Kind("pii:ssn", "SSN", rb"\b\d{3}-\d{2}-\d{4}\b", check=_ssn),
    "ip": Kind("pii:ip", "IP", rb"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b", check=_ip),
}

#: Injection attempts: the common phrasings, matched without regard to case.
INJECTION: Final = (
    Kind(
        "injection:ignore_instructions",
        "INJECTION",
        rb"\b(?:ignore|disregard|forget|override)\s+(?:all\s+|any\s+)?(?:of\s+)?(?:the\s+|your\s+|my\s+)?(?:previous|prior|above|earlier|preceding|system)\s+(?:instructions|prompts?|rules|directions|guidelines)",
        caseless=True,
    ),
    Kind(
        "injection:reveal_prompt",
        "INJECTION",
        rb"\b(?:reveal|print|show|repeat|output)\s+(?:me\s+)?(?:your|the)\s+(?:system\s+prompt|hidden\s+instructions|initial\s+instructions)",
        caseless=True,
    ),
    Kind(
        "injection:jailbreak",
        "INJECTION",
        rb"\b(?:you\s+are\s+now\s+(?:DAN|in\s+developer\s+mode|jailbroken)|do\s+anything\s+now|developer\s+mode\s+enabled)",
        caseless=True,
    ),
)
