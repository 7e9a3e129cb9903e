"""A small synchronous client of the admin API (httpx), for one-shot
commands such as ``llmgw ctl …`` and ``llmgw keys …``.

Errors it raises are in :mod:`llmgw.errors`:

- :class:`~llmgw.auth.admin_token.AdminTokenMissing` (``NotFound``): no
  admin token in the data directory;
- :class:`AdminUnreachable` (``UpstreamError``): no answer, or an answer
  that is not JSON;
- :class:`AdminRefused` (``Refused``): the API answered an error; it
  carries the status, the error's ``code`` and its message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Final

import httpx

from llmgw import errors
from llmgw.auth.admin_token import ADMIN_TOKEN_FILE, read_admin_token

__all__ = [
    "ADMIN_TIMEOUT_S",
    "DEFAULT_ADMIN",
    "AdminClient",
    "AdminRefused",
    "AdminUnreachable",
    "AsyncAdminClient",
]

#: Deadline for one admin API call, in seconds.
ADMIN_TIMEOUT_S: Final = 30.0
#: The admin API's address when the data directory's ``run.json`` names none.
DEFAULT_ADMIN: Final = "127.0.0.1:9090"


class AdminUnreachable(errors.UpstreamError):
    """The admin API did not answer, or answered something that is not JSON."""


class AdminRefused(errors.Refused):
    """The admin API answered an error.

    Printed as ``STATUS: message``.

    Attributes:
        status: the HTTP status.
        code: the error's ``code`` (``model_not_found``, …), or ``""``.
        detail: the error's ``message`` (else the body).
    """

    def __init__(self, status: int, detail: str, code: str = "") -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail
        self.code = code

    @classmethod
    def from_response(cls, response: httpx.Response) -> AdminRefused:
        """The error in ``response``: its ``error.message`` and ``error.code``
        when the body has the admin API's error shape, else the whole body."""
        try:
            error = response.json()["error"]
            message, code = str(error["message"]), str(error.get("code") or "")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, code = response.text, ""
        return cls(response.status_code, message, code)


class AdminClient:
    """Calls to the admin API at ``base_url`` with the admin token ``key``.

    Each call opens its own connection and is bounded by
    :data:`ADMIN_TIMEOUT_S`.
    """

    def __init__(self, base_url: str, key: str) -> None:
        self.base_url = base_url
        self.key = key

    @classmethod
    def from_data_dir(cls, data_dir: Path) -> AdminClient:
        """The client of the llmgw whose data directory is ``data_dir``: its
        ``admin-token``, and the admin address in its ``run.json`` (written by
        ``llmgw up``; :data:`DEFAULT_ADMIN` when absent).

        Raises:
            AdminTokenMissing: no ``admin-token`` file, or no token in it.
        """
        key = read_admin_token(data_dir / ADMIN_TOKEN_FILE)
        admin = DEFAULT_ADMIN
        try:
            admin = json.loads((data_dir / "run.json").read_text())["admin"]
        except (FileNotFoundError, KeyError, ValueError):
            pass
        return cls(f"http://{admin}", key)

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """``method path`` (``kwargs`` as for :meth:`httpx.Client.request`:
        ``json``, ``params``) → the answer's JSON.

        Raises:
            AdminRefused: the API answered 400 or above.
            AdminUnreachable: no answer, or not JSON.
        """
        try:
            with httpx.Client(base_url=self.base_url, timeout=ADMIN_TIMEOUT_S) as client:
                response = client.request(method, path, headers=self._headers(), **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code >= 400:
            raise AdminRefused.from_response(response)
        try:
            return response.json()
        except ValueError:
            raise AdminUnreachable(
                f"the admin API answered something that is not JSON: {response.text[:200]}"
            ) from None

    def stream(self, path: str, params: dict[str, Any], out: IO[bytes]) -> None:
        """``GET path`` and copy the body to ``out`` as it arrives.

        Raises:
            AdminRefused: the API answered 400 or above (nothing is written).
            AdminUnreachable: no answer, or the connection broke.
        """
        try:
            with (
                httpx.Client(base_url=self.base_url, timeout=ADMIN_TIMEOUT_S) as client,
                client.stream("GET", path, params=params, headers=self._headers()) as response,
            ):
                if response.status_code >= 400:
                    response.read()
                    raise AdminRefused.from_response(response)
                for chunk in response.iter_bytes():
                    out.write(chunk)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def _unreachable(self, exc: httpx.HTTPError) -> AdminUnreachable:
        return AdminUnreachable(
            f"cannot reach the admin API at {self.base_url} ({errors.describe(exc)}); "
            "is llmgw running?"
        )


# --- the asynchronous client, for the console (asyncio) -------------------------------


class AsyncAdminClient:
    """The admin API at ``base_url`` with the admin token ``key``, for a
    long-lived asyncio program (``llmgw console``): one pooled
    :class:`httpx.AsyncClient`, each call bounded by ``timeout_s`` seconds.
    Same answers and errors as :class:`AdminClient`; close it with
    :meth:`aclose` (or ``async with``)."""

    def __init__(self, base_url: str, key: str, *, timeout_s: float = ADMIN_TIMEOUT_S) -> None:
        self.base_url = base_url
        self.key = key
        self._http = httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout_s,
            headers={"authorization": f"Bearer {key}"},
        )

    @classmethod
    def from_data_dir(
        cls, data_dir: Path, *, timeout_s: float = ADMIN_TIMEOUT_S
    ) -> AsyncAdminClient:
        """As :meth:`AdminClient.from_data_dir`.

        Raises:
            AdminTokenMissing: no ``admin-token`` file, or no token in it.
        """
        sync = AdminClient.from_data_dir(data_dir)
        return cls(sync.base_url, sync.key, timeout_s=timeout_s)

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """``method path`` → the answer's JSON.

        Raises:
            AdminRefused: the API answered 400 or above.
            AdminUnreachable: no answer within the deadline, or not JSON.
        """
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise AdminUnreachable(
                f"cannot reach the admin API at {self.base_url} ({errors.describe(exc)})"
            ) from exc
        if response.status_code >= 400:
            raise AdminRefused.from_response(response)
        try:
            return response.json()
        except ValueError:
            raise AdminUnreachable(
                f"the admin API answered something that is not JSON: {response.text[:200]}"
            ) from None

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncAdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
