"""What every target shares: atheris set up to instrument llmgw's parsers
(and the libraries they parse with), and a helper to cut bytes anywhere."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import atheris

#: Packages instrumented for coverage: llmgw and the parsers it hands bytes to.
INSTRUMENTED = ("llmgw", "h11", "yaml", "cattrs", "msgpack")


@contextmanager
def instrumented(extra: Sequence[str] = ()) -> Iterator[None]:
    """Import the code under test inside this block, so atheris instruments it."""
    with atheris.instrument_imports(include=[*INSTRUMENTED, *extra]):
        yield


def cut(data: bytes, seed: int, most: int = 8) -> list[bytes]:
    """``data`` cut into at most ``most`` pieces at places ``seed`` picks."""
    if len(data) < 2:
        return [data]
    chooser = random.Random(seed)
    count = chooser.randint(0, min(most - 1, len(data) - 1))
    places = sorted(chooser.sample(range(1, len(data)), count))
    return [data[a:b] for a, b in zip([0, *places], [*places, len(data)], strict=True)]


def fuzz(one_input: Callable[[bytes], None]) -> None:
    """Run libFuzzer over ``one_input`` with the command line's options."""
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
