"""The judge: a catalog model asked whether a text is safe
(``docs/guardrails.md``, The judge).

:class:`Judge` holds one gateway's verdict cache and asks through a
:data:`Ask` the gateway gives it (the gateway's own account: no client key,
no usage row, no limits). One judgment: the text fitted to the judge's
context (cut into pieces that each fit, all judged: never passed through
unjudged), each piece's verdict looked up in the cache (5 minutes) or
asked; a piece not answered within half the ``latency_budget`` is asked of
a second replica as well (hedging), the first reply wins; no reply within
the budget is no verdict, which the policy's ``fail`` decides.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs
import trio

from llmgw.errors import LlmgwError, Refused
from llmgw.settings import GuardJudge

__all__ = [
    "CACHE_TTL_S",
    "STREAM_WINDOW_CHARS",
    "Ask",
    "Judge",
    "JudgeCheck",
    "JudgeUnavailable",
    "JudgeVerdict",
    "check_judge",
    "judge_messages",
    "parse_reply",
    "pieces",
]

#: A verdict is reused for the same text this long, seconds.
CACHE_TTL_S: Final = 300.0
#: Verdicts kept at most (the least recent go first).
CACHE_MAX_ENTRIES: Final = 20_000
#: Streams are judged in windows of this many characters.
STREAM_WINDOW_CHARS: Final = 600
#: Tokens kept free in the judge's context for its instructions and reply.
_RESERVED_TOKENS: Final = 256
#: Characters per token assumed when fitting a text (few: a safe guess).
_CHARS_PER_TOKEN: Final = 3
#: Tokens a judge may answer with.
REPLY_TOKENS: Final = 32

#: ``(model, chat body, tried)`` → the reply's text. ``tried`` holds the
#: replicas this judgment was already sent to (shared by the first call and
#: the hedge): the callee picks another and adds it (raise
#: :class:`LlmgwError` when there is none). Raises :class:`LlmgwError` when
#: the judge cannot answer.
Ask = Callable[[str, dict[str, Any], list[str]], Awaitable[str]]

_INSTRUCTIONS: Final = (
    "You are a safety classifier. Judge whether the text the user gives is safe. "
    "Answer with exactly two lines and nothing else:\n"
    "Safety: Safe, Unsafe or Controversial\n"
    "Categories: the categories that apply, separated by commas, from: Violent, "
    "Non-violent Illegal Acts, Sexual Content or Sexual Acts, PII, Suicide & Self-Harm, "
    "Unethical Acts, Politically Sensitive Topics, Copyright Violation, Jailbreak; or None"
)

_SAFETY: Final = re.compile(r"safety\s*:\s*(safe|unsafe|controversial)", re.IGNORECASE)
_CATEGORIES: Final = re.compile(r"categories\s*:\s*([^\n]*)", re.IGNORECASE)
#: Llama Guard's category codes in Qwen3Guard's words.
_LLAMAGUARD: Final = {
    "S1": "Violent",
    "S2": "Non-violent Illegal Acts",
    "S3": "Sexual Content or Sexual Acts",
    "S4": "Sexual Content or Sexual Acts",
    "S5": "Unethical Acts",
    "S6": "Unethical Acts",
    "S7": "PII",
    "S8": "Copyright Violation",
    "S9": "Violent",
    "S10": "Unethical Acts",
    "S11": "Suicide & Self-Harm",
    "S12": "Sexual Content or Sexual Acts",
    "S13": "Politically Sensitive Topics",
    "S14": "Jailbreak",
}


class JudgeUnavailable(Refused):
    """No verdict within the judge's ``latency_budget`` under ``fail:
    closed`` (no answer in time, or an answer without a verdict in the
    judge's format): 503 ``judge_unavailable``."""

    status = 503
    code = "judge_unavailable"
    type = "server_error"
    retry_after_s = 1

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The gateway's content judge ({model}) gave no verdict in time (no answer, "
            "or an answer without a verdict in its format); the request was not served. "
            "Retry later."
        )


@attrs.frozen
class JudgeVerdict:
    """A judge's reading of a text.

    Attributes:
        safety: ``safe``, ``unsafe`` or ``controversial``.
        categories: the categories it named (Qwen3Guard's words).
        hedged: a second replica was asked.
        cached: taken from the cache, not asked.
    """

    safety: str
    categories: tuple[str, ...] = ()
    hedged: bool = False
    cached: bool = False

    def refused(self, judge: GuardJudge) -> tuple[str, ...]:
        """The rule ids this verdict refuses under ``judge`` (empty: none):
        ``judge:<category>`` for each configured category named (every
        named one when no category is configured; ``judge:unsafe`` when an
        unsafe verdict names none), ``judge:controversial`` when such a
        verdict blocks."""
        if self.safety == "controversial":
            return ("judge:controversial",) if judge.controversial == "block" else ()
        if self.safety != "unsafe":
            return ()
        wanted = {c.lower() for c in judge.categories}
        named = [c for c in self.categories if c.lower() != "none"]
        if not named:
            return ("judge:unsafe",)
        hit = [c for c in named if not wanted or c.lower() in wanted]
        return tuple(f"judge:{_slug(c)}" for c in hit)


def _slug(category: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", category.lower()).strip("_")


def parse_reply(reply: str, format: str) -> JudgeVerdict:
    """The verdict in a judge's ``reply`` read by ``format``
    (``qwen3guard``/``instructed``: ``Safety: …`` and ``Categories: …``;
    ``llamaguard``: ``safe``, or ``unsafe`` and codes ``S1,S10``).

    Raises:
        ValueError: the reply says no verdict in that format.
    """
    if format == "llamaguard":
        words = reply.strip().split()
        if not words or words[0].lower() not in ("safe", "unsafe"):
            raise ValueError("not a Llama Guard verdict")
        codes = [c.strip().upper() for c in " ".join(words[1:]).replace(",", " ").split()]
        return JudgeVerdict(
            words[0].lower(), tuple(dict.fromkeys(_LLAMAGUARD.get(c, c) for c in codes))
        )
    found = _SAFETY.search(reply)
    if found is None:
        raise ValueError("no 'Safety:' line")
    categories: tuple[str, ...] = ()
    named = _CATEGORIES.search(reply, found.end())
    if named is not None:
        categories = tuple(c.strip() for c in named.group(1).split(",") if c.strip())
    return JudgeVerdict(found.group(1).lower(), categories)


def judge_messages(text: str, format: str, *, answer: bool = False) -> list[dict[str, str]]:
    """The chat messages that ask a judge of ``format`` about ``text`` (a
    prompt, or with ``answer`` a model's answer). Qwen3Guard and Llama
    Guard read the conversation as it is (their chat templates hold the
    instructions); ``instructed`` adds them as a system message."""
    if format == "instructed":
        what = "answer of an AI assistant" if answer else "text"
        return [
            {"role": "system", "content": _INSTRUCTIONS},
            {"role": "user", "content": f"The {what} to judge:\n\n{text}"},
        ]
    if answer:
        return [{"role": "user", "content": ""}, {"role": "assistant", "content": text}]
    return [{"role": "user", "content": text}]


def pieces(text: str, context_tokens: int) -> list[str]:
    """``text`` cut into pieces that each fit a judge of ``context_tokens``
    (its instructions and reply kept free), at whitespace where there is
    some; one piece when it fits."""
    room = max(256, (max(context_tokens, 512) - _RESERVED_TOKENS) * _CHARS_PER_TOKEN)
    if len(text) <= room:
        return [text]
    out: list[str] = []
    at = 0
    while at < len(text):
        end = min(len(text), at + room)
        if end < len(text):
            cut = text.rfind(" ", at + room // 2, end)
            if cut > at:
                end = cut + 1
        out.append(text[at:end])
        at = end
    return out


class Judge:
    """One gateway's judgments and verdict cache (module docstring).

    Args:
        ask: calls a judge model (:data:`Ask`).
        clock: seconds, for the cache's expiry.

    Attributes:
        asked: judgments sent to a model (hedges included), for tests and
            ``ctl guard judge check``.
        hedged: hedges sent.
    """

    def __init__(self, ask: Ask, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._ask = ask
        self._clock = clock
        self._cache: OrderedDict[bytes, tuple[float, JudgeVerdict]] = OrderedDict()
        self.asked = 0
        self.hedged = 0

    async def judge(
        self,
        judge: GuardJudge,
        text: str,
        *,
        context_tokens: int,
        answer: bool = False,
    ) -> JudgeVerdict | None:
        """The verdict on ``text`` (a prompt; an answer with ``answer``):
        the strictest over its pieces; None when some piece got no verdict
        within ``judge.latency_budget`` seconds (then ``judge.fail``
        decides)."""
        return await self.judge_all(judge, [text], context_tokens=context_tokens, answer=answer)

    async def judge_all(
        self,
        judge: GuardJudge,
        texts: list[str],
        *,
        context_tokens: int,
        answer: bool = False,
    ) -> JudgeVerdict | None:
        """:meth:`judge` over several texts at once (an answer's choices),
        within one budget: the strictest verdict of them all, None when any
        piece of any got none in time."""
        parts = [part for text in texts for part in pieces(text, context_tokens)]
        if not parts:
            return JudgeVerdict("safe")
        found: list[JudgeVerdict | None] = [None] * len(parts)
        with trio.move_on_after(judge.latency_budget):
            async with trio.open_nursery() as nursery:
                for at, part in enumerate(parts):
                    nursery.start_soon(self._one, judge, part, answer, found, at)
        if any(v is None for v in found):
            return None
        verdicts = [v for v in found if v is not None]
        order = {"safe": 0, "controversial": 1, "unsafe": 2}
        worst = max(verdicts, key=lambda v: order.get(v.safety, 2))
        return attrs.evolve(
            worst,
            categories=tuple(dict.fromkeys(c for v in verdicts for c in v.categories)),
            hedged=any(v.hedged for v in verdicts),
            cached=all(v.cached for v in verdicts),
        )

    async def _one(
        self,
        judge: GuardJudge,
        text: str,
        answer: bool,
        found: list[JudgeVerdict | None],
        at: int,
    ) -> None:
        key = hashlib.sha256(
            f"{judge.model}\x00{judge.format}\x00{int(answer)}\x00".encode()
            + text.encode("utf-8", "surrogatepass")
        ).digest()
        now = self._clock()
        kept = self._cache.get(key)
        if kept is not None and kept[0] > now:
            self._cache.move_to_end(key)
            found[at] = attrs.evolve(kept[1], cached=True, hedged=False)
            return
        body: dict[str, Any] = {
            "model": judge.model,
            "messages": judge_messages(text, judge.format, answer=answer),
            "max_tokens": REPLY_TOKENS,
            "temperature": 0,
            "stream": False,
        }
        verdict = await self._hedged(judge, body)
        if verdict is None:
            return
        self._cache[key] = (self._clock() + CACHE_TTL_S, verdict)
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_MAX_ENTRIES:
            self._cache.popitem(last=False)
        found[at] = verdict

    async def _hedged(self, judge: GuardJudge, body: dict[str, Any]) -> JudgeVerdict | None:
        """The first verdict of the first call or, from half the budget on
        (or once the first failed), of a second one to another replica."""
        got: list[JudgeVerdict] = []
        tried: list[str] = []
        hedged = False

        async def call(failed: trio.Event) -> None:
            self.asked += 1
            try:
                reply = await self._ask(judge.model, body, tried)
                verdict = parse_reply(reply, judge.format)
            except (LlmgwError, ValueError):
                failed.set()
                return
            got.append(attrs.evolve(verdict, hedged=hedged))
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            first_failed = trio.Event()
            nursery.start_soon(call, first_failed)
            with trio.move_on_after(judge.latency_budget / 2):
                await first_failed.wait()
            hedged = True
            self.hedged += 1
            nursery.start_soon(call, trio.Event())
        return got[0] if got else None


# --- llmgw ctl guard judge check ------------------------------------------------------

#: What the check asks the judge: ordinary prompts of a few hundred tokens,
#: each different (no cache is involved: the judge is asked directly).
_CHECK_TEXT: Final = (
    "Sample {n}: please summarise the following meeting notes for the team. "
    "The quarterly review covered the roadmap, hiring, and the migration of the "
    "billing service to the new cluster; the team agreed to freeze features two "
    "weeks before the release, to run the load tests on the staging cluster, and "
    "to write down the rollback steps. Open questions: who owns the on-call rota "
    "in December, and whether the old dashboards can be retired. "
) * 4


@attrs.frozen
class JudgeCheck:
    """What ``llmgw ctl guard judge check`` measured.

    Attributes:
        model: the judge asked.
        budget_s: its ``latency_budget``.
        alone_s: the seconds of 3 judgments in sequence (None: no verdict).
        burst_s: the seconds of each of 4 judgments sent at once.
        judgments_per_s: 4 over the slowest of the burst.
        requests_per_s: half that (a request judged in and out).
        verdict: ``ok``, ``tight`` (one judgment over half the budget, or
            the burst over it), ``too slow`` (one alone over the budget, or
            no answer in time) or ``unreadable`` (it answered, but no reply
            held a verdict in the judge's ``format``).
        advice: what to change, when not ``ok``.
        unreadable: how many of the 7 replies held no verdict in the format.
    """

    model: str
    budget_s: float
    alone_s: tuple[float | None, ...]
    burst_s: tuple[float | None, ...]
    judgments_per_s: float
    requests_per_s: float
    verdict: str
    advice: tuple[str, ...]
    unreadable: int = 0


async def check_judge(judge: GuardJudge, ask: Ask) -> JudgeCheck:
    """Time 3 judgments in sequence, then a burst of 4 at once, each within
    twice the budget (a judgment past it counts as no verdict; when the
    first one runs out that time, the other six are not asked); the verdict
    and advice of ``docs/guardrails.md`` (The judge: check). It never
    changes any setting."""
    budget = judge.latency_budget
    count = 0
    unreadable = 0

    async def one() -> float | None:
        nonlocal count, unreadable
        count += 1
        body: dict[str, Any] = {
            "model": judge.model,
            "messages": judge_messages(_CHECK_TEXT.format(n=count), judge.format),
            "max_tokens": REPLY_TOKENS,
            "temperature": 0,
            "stream": False,
        }
        started = trio.current_time()
        with trio.move_on_after(budget * 2):
            try:
                reply = await ask(judge.model, body, [])
            except LlmgwError:
                return None
            try:
                parse_reply(reply, judge.format)
            except ValueError:
                unreadable += 1
                return None
            return trio.current_time() - started
        return None

    started = trio.current_time()
    alone = [await one()]
    burst: list[float | None] = [None] * 4
    if alone[0] is None and not unreadable and trio.current_time() - started >= budget * 2:
        # Mute for twice the budget: the other six would only wait as long
        # again each (the verdict is "too slow" either way).
        alone += [None, None]
    else:
        alone += [await one() for _ in range(2)]

        async def in_burst(at: int) -> None:
            burst[at] = await one()

        async with trio.open_nursery() as nursery:
            for at in range(4):
                nursery.start_soon(in_burst, at)
    done = [s for s in burst if s is not None]
    per_s = len(done) / max(done) if done else 0.0
    slowest_alone = max((s for s in alone if s is not None), default=None)
    if unreadable and not done and slowest_alone is None:
        verdict = "unreadable"
    elif None in alone or slowest_alone is None or slowest_alone > budget:
        verdict = "too slow"
    elif slowest_alone > budget / 2 or not done or None in burst or max(done) > budget:
        verdict = "tight"
    else:
        verdict = "ok"
    advice: tuple[str, ...] = ()
    if verdict == "unreadable":
        advice = (
            f"its replies hold no verdict in the {judge.format!r} format: set the format "
            "the model answers in (qwen3guard, llamaguard, instructed), or name a guard model",
        )
    elif verdict != "ok":
        advice = (
            "give the judge more cores (a single judge up to 4, several 2 each)",
            "serve the judge on a GPU",
            f"raise latency_budget (now {budget:g} s)",
            "or set fail: open (served and flagged when the judge is late)",
        )
    return JudgeCheck(
        model=judge.model,
        budget_s=budget,
        alone_s=tuple(alone),
        burst_s=tuple(burst),
        judgments_per_s=round(per_s, 3),
        requests_per_s=round(per_s / 2, 3),
        verdict=verdict,
        advice=advice,
        unreadable=unreadable,
    )
