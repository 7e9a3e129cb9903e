"""The built-in pattern rules: what each kind looks like, and the checks a
candidate must pass before it counts (Luhn for cards, mod 97 for IBANs).

Patterns are written for hyperscan (no look-arounds, no back-references);
what they cannot say is said by a check over the matched bytes and their
neighbours. ``docs/guardrails.md`` lists the kinds.
"""

from __future__ import annotations

import functools
import importlib
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
    "person_kinds",
    "pii_kinds",
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


# --- person names -----------------------------------------------------------------------

#: The locales whose first names (from Faker's person providers) are known.
PERSON_LOCALES: Final = (
    "en",
    "en_US",
    "en_IN",
    "en_PK",
    "en_KE",
    "ig_NG",
    "yo_NG",
    "ha_NG",
    "en_GB",
    "de_DE",
    "fr_FR",
    "es_ES",
    "it_IT",
    "nl_NL",
    "pt_BR",
    "pl_PL",
    "sv_SE",
)
#: First names that are also ordinary capitalised words (months, virtues,
#: places, brands, languages): never taken as the start of a name.
_AMBIGUOUS_FIRST: Final = frozenset(
    [
        "Will",
        "May",
        "June",
        "April",
        "August",
        "Mark",
        "Bill",
        "Grace",
        "Hope",
        "Faith",
        "Joy",
        "Rose",
        "Art",
        "Don",
        "Guy",
        "Pat",
        "Sue",
        "Rich",
        "Frank",
        "Jack",
        "Max",
        "Sky",
        "Summer",
        "Autumn",
        "Dawn",
        "Amber",
        "Crystal",
        "Jade",
        "Pearl",
        "Holly",
        "Ivy",
        "Iris",
        "Lily",
        "Daisy",
        "Violet",
        "Olive",
        "Ginger",
        "Candy",
        "Brandy",
        "Sandy",
        "Misty",
        "Page",
        "Chase",
        "Chance",
        "Hunter",
        "Mason",
        "Cooper",
        "Parker",
        "Tanner",
        "Miles",
        "Major",
        "King",
        "Prince",
        "Earl",
        "Duke",
        "Royal",
        "Sterling",
        "Angel",
        "Christian",
        "Destiny",
        "Harmony",
        "Melody",
        "Liberty",
        "Justice",
        "Trinity",
        "Unity",
        "Star",
        "Sunny",
        "Paris",
        "Florence",
        "Austin",
        "Dallas",
        "Houston",
        "Phoenix",
        "Jordan",
        "Sydney",
        "Victoria",
        "Georgia",
        "Virginia",
        "Carolina",
        "Dakota",
        "Montana",
        "Chelsea",
        "Brooklyn",
        "Lincoln",
        "Washington",
        "Kennedy",
        "Harley",
        "Mercedes",
        "Ruby",
        "Julia",
        "Ada",
        "Scala",
        "Dart",
        "Elm",
        "Perl",
        "Go",
        "Basil",
        "Clay",
        "Cliff",
        "Dale",
        "Glen",
        "Heath",
        "Forrest",
        "River",
        "Rock",
        "Stone",
        "Storm",
        "Rain",
        "Reed",
        "Wade",
        "Penny",
        "Sherry",
        "Brook",
        "Bay",
        "Cash",
        "Gage",
        "Ray",
        "Drew",
        "Gene",
        "Lane",
        "Lee",
        "Long",
        "Young",
        "Price",
        "Hall",
        "Wolf",
        "Fox",
        "Christ",
        "Jesus",
        "God",
        "Buddha",
        "Alpha",
        "Delta",
        "Echo",
        "Nova",
        "Luna",
        "Aurora",
        "Apollo",
        "Atlas",
        "Orion",
        "Titan",
        "Zeus",
        "Juno",
        "Venus",
        "Mars",
        "Mercury",
        "Neptune",
        "Pluto",
        "Saturn",
        "Jupiter",
        "Windows",
        "Linux",
        "Docker",
        "Kafka",
        "Redis",
        "Jenkins",
        "Alexa",
        "Siri",
        "Cortana",
        "Tesla",
        "Amazon",
        "Apple",
        "Nike",
        "Adidas",
        "Dior",
        "Chanel",
        "Gucci",
        "Sage",
        "Rowan",
        "Ash",
        "Oakley",
        "Willow",
        "Aspen",
        "Cedar",
        "Maple",
        "Hazel",
        "Laurel",
        "Heather",
        "Fern",
        "Sierra",
        "Savannah",
        "Asia",
        "Africa",
        "America",
        "China",
        "India",
        "Kenya",
        "Israel",
        "Jersey",
        "Trent",
        "Derby",
        "Camden",
        "Kent",
        "Essex",
        "Salem",
        "Eden",
        "Zion",
        "General",
        "Red",
        "Van",
        "Von",
        "Del",
        "Della",
        "Le",
        "La",
        "El",
        "Sami",
        "Tab",
    ]
)
#: Capitalised words that do not end a name (``Maria Street``, ``Jack And``).
_NOT_SURNAMES: Final = frozenset(
    [
        "The",
        "A",
        "An",
        "And",
        "Or",
        "But",
        "Nor",
        "So",
        "Yet",
        "In",
        "On",
        "At",
        "To",
        "For",
        "Of",
        "From",
        "By",
        "With",
        "Is",
        "Was",
        "Are",
        "Were",
        "Be",
        "It",
        "Its",
        "This",
        "That",
        "These",
        "Those",
        "We",
        "You",
        "He",
        "She",
        "They",
        "I",
        "My",
        "Your",
        "His",
        "Her",
        "Our",
        "Their",
        "Who",
        "What",
        "When",
        "Where",
        "Why",
        "How",
        "Not",
        "No",
        "Yes",
        "If",
        "Then",
        "Than",
        "As",
        "Also",
        "Just",
        "Only",
        "Street",
        "Road",
        "Avenue",
        "Lane",
        "Drive",
        "Boulevard",
        "Way",
        "Square",
        "Park",
        "Bridge",
        "River",
        "Lake",
        "Mountain",
        "Valley",
        "Station",
        "Airport",
        "University",
        "College",
        "School",
        "Academy",
        "Institute",
        "Hospital",
        "Clinic",
        "Church",
        "Hall",
        "Center",
        "Centre",
        "Museum",
        "Library",
        "Hotel",
        "Inc",
        "Ltd",
        "Corp",
        "Company",
        "Group",
        "Bank",
        "City",
        "County",
        "State",
        "Province",
        "Island",
        "Beach",
        "Bay",
        "Street",
        "Day",
        "Night",
        "Morning",
        "Evening",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
        "Said",
        "Says",
        "Wrote",
        "Asked",
        "St",
        "Ave",
        "Rd",
        "Contributors",
        "Foundation",
        "Project",
        "Team",
        "Software",
        "Public",
        "License",
        "Authors",
        "Developers",
    ]
)
_SURNAME: Final = rb"[A-Z](?:[a-z]|[\xc3-\xc5][\x80-\xbf])+(?:-[A-Z][a-z]+)?"
_TITLES: Final = rb"(?:Mr|Mrs|Ms|Mx|Dr|Prof|Sir|Dame|Herr|Frau|Mme|Mlle|Sr|Sra)"


@functools.cache
def first_names() -> frozenset[str]:
    """The first names of :data:`PERSON_LOCALES` (Faker's lists), without
    :data:`_AMBIGUOUS_FIRST`; read once, on the first policy that names
    ``person``."""
    names: set[str] = set()
    for locale in PERSON_LOCALES:
        provider = importlib.import_module(f"faker.providers.person.{locale}").Provider
        found = provider.first_names
        if isinstance(found, (list, tuple, dict)):
            names.update(n for n in found if n.isalpha() and n[:1].isupper() and len(n) > 2)
    return frozenset(names - _AMBIGUOUS_FIRST)


def _surname_ok(data: bytes, start: int, end: int) -> bool:
    """The candidate's last word may end a name (not ``Street``, not in
    capitals) and no further capitalised word follows (``John Smith
    Street`` is a place)."""
    last = data[start:end].rsplit(b" ", 1)[-1].decode("utf-8", "replace")
    if last in _NOT_SURNAMES or last.upper() == last:
        return False
    after = data[end : end + 2]
    return not (after[:1] == b" " and after[1:2].isupper())


def _person(data: bytes, start: int, end: int) -> bool:
    """A known first name (its part before a hyphen), then a surname."""
    first = data[start:end].split(b" ", 1)[0].split(b"-", 1)[0]
    return first.decode("utf-8", "replace") in first_names() and _surname_ok(data, start, end)


def _titled(data: bytes, start: int, end: int) -> bool:
    return _surname_ok(data, start, end)


@functools.cache
def person_kinds() -> tuple[Kind, ...]:
    """``pii:person``: a known first name then a capitalised surname
    (``Maria Lopez``, ``Jean-Luc Picard``, ``John F. Kennedy``), or a title
    then one or two names (``Dr. Watson``, ``Mrs Jane Doe``); case matters.
    Hyperscan finds every pair of capitalised words; the check looks the
    first up in :func:`first_names` (a set)."""
    first_names()  # read the names now, not on the first request
    return (
        Kind(
            "pii:person",
            "PERSON",
            rb"\b" + _TITLES + rb"\.? " + _SURNAME + rb"(?: " + _SURNAME + rb")?\b",
            check=_titled,
        ),
        Kind(
            "pii:person",
            "PERSON",
            rb"\b" + _SURNAME + rb" (?:[A-Z]\. )?" + _SURNAME + rb"\b",
            check=_person,
        ),
    )


def pii_kinds(name: str) -> tuple[Kind, ...]:
    """The pattern kinds of the PII kind called ``name`` (:data:`PII`, or
    ``person``'s two)."""
    return person_kinds() if name == "person" else (PII[name],)
