"""The portal and the admin pages (``docs/portal.md``): one quart-trio app
of server-rendered pages, served on the client port (beside ``/v1``, which
never passes through it) and on the admin listener.

Pages:

- ``/portal/sign-in`` (GET, POST), ``/portal/sign-out`` (POST),
  ``/portal/sign-up`` (GET, POST; only while ``auth.signup_open``: the
  account then awaits approval);
- ``/portal/chat``, ``/portal/keys`` (+ POST make, POST ``…/KEY/revoke``),
  ``/portal/connect``, ``/portal/usage`` (+ ``/portal/usage.csv``),
  ``/portal/models``;
- ``/admin`` and ``/admin/people|tree|models|nodes|usage`` for signed-in
  people with a staff role; each renders only the forms the role may submit
  (:data:`CAN`), and each POST checks the role again;
- ``/static/<hashed name>`` (:mod:`llmgw.portal.assets`); ``/`` redirects.

On the client port every page answers 404 while ``portal.enabled`` is
false; the Connect page shows ``portal.external_url`` when it is set.

Every POST carries the session's CSRF token (the sign-in form a
double-submit token in a cookie); without it, or with a wrong one, it is
refused (403) and nothing changes. A key or usage that is not the person's
(or, for a manager, their project's) answers 404 whatever its id.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import quote, urlsplit

import attrs
from quart import Response, g, redirect, render_template, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from llmgw import errors
from llmgw.accounting.accountant import Accountant
from llmgw.admin.keys import KeysService
from llmgw.admin.people import membership_target, person_view
from llmgw.auth.people import (
    CHAT_KEY_NAME,
    STAFF_ROLES,
    LastAdmin,
    People,
    SignedIn,
    WrongState,
)
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster
from llmgw.store import KeyRecord, Membership, ProjectPath, Store

from .assets import asset_url, find_asset
from .usage import bar_chart, daily, money, rows_for, to_csv

__all__ = ["CAN", "SESSION_COOKIE", "make_portal_app"]

SESSION_COOKIE: Final = "llmgw_session"
_SIGNIN_COOKIE: Final = "llmgw_signin"
#: Which staff roles may submit which admin forms.
CAN: Final[Mapping[str, frozenset[str]]] = {
    "people": frozenset({"admin"}),
    "limits": frozenset({"admin", "billing"}),
}
_CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
_REFRESH_MS: Final = 10_000


class _Redirect(Exception):
    def __init__(self, to: str) -> None:
        self.to = to


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


@attrs.frozen
class _Scopes:
    """A person's projects: where they may make keys, and which they manage."""

    member: list[ProjectPath]
    managed: list[ProjectPath]


def make_portal_app(
    store: Store,
    cluster: Cluster,
    people: People,
    keys: KeysService,
    *,
    admin_listener: bool = False,
    resolver: ScopeResolver | None = None,
    accountant: Accountant | None = None,
) -> QuartTrio:
    """The pages over ``store`` and ``cluster``.

    Args:
        admin_listener: served on the admin listener: ``/`` leads to
            ``/admin`` and the person's pages are not linked.
        resolver, accountant: the gateway's own: the Chat, Models and
            Connect pages list only the models the session's chat key may
            call (:meth:`Accountant.allowed` along the key's path). Without
            them (tests of other things), every model is listed.
    """
    app = QuartTrio("llmgw.portal", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024

    # --- plumbing ------------------------------------------------------
    def client() -> str:
        return request.remote_addr or "?"

    def secure() -> bool:
        return request.scheme == "https"

    def set_form_cookie(response: Any, token: str, path: str) -> None:
        """The sign-in or sign-up form's CSRF cookie, for its own path only."""
        response.set_cookie(
            _SIGNIN_COOKIE, token, httponly=True, samesite="Strict", secure=secure(), path=path
        )

    async def signed_in() -> SignedIn:
        token = request.cookies.get(SESSION_COOKIE, "")
        found = await people.session(token)
        if found is None:
            target = request.path if request.method == "GET" else "/"
            raise _Redirect("/portal/sign-in?next=" + quote(target, safe="/"))
        g.token = token
        g.signed = found
        return found

    async def posted(signed: SignedIn) -> dict[str, str]:
        form = await request.form
        if not people.check_csrf(g.token, form.get("csrf", "")):
            raise _Refused(403, "This form is stale or was not sent from llmgw's own page (CSRF).")
        return {k: form.get(k, "") for k in form}

    def staff(signed: SignedIn, may: str | None = None) -> None:
        role = signed.person.staff_role
        if not role or (may is not None and role not in CAN[may]):
            raise _Refused(403, "Your staff role does not allow this.")

    async def page(template: str, title: str, **context: Any) -> Response:
        signed: SignedIn | None = getattr(g, "signed", None)
        body = await render_template(
            template,
            title=title,
            me=signed.person if signed else None,
            csrf=people.csrf_token(g.token) if signed else "",
            portal=not admin_listener,
            here=request.path,
            asset=asset_url,
            refresh_ms=_REFRESH_MS,
            can={
                name: bool(signed and signed.person.staff_role in roles)
                for name, roles in CAN.items()
            },
            **context,
        )
        return Response(body, content_type="text/html; charset=utf-8")

    @app.before_request
    async def portal_enabled() -> Any:
        if not admin_listener and not cluster.settings.portal.enabled:
            return Response(
                "The portal is turned off (portal.enabled).", status=404, content_type="text/plain"
            )
        return None

    @app.after_request
    async def headers(response: Response) -> Response:
        response.headers.setdefault("Content-Security-Policy", _CSP)
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    @app.errorhandler(_Redirect)
    async def go(exc: _Redirect) -> Any:
        return redirect(exc.to, 303)

    @app.errorhandler(_Refused)
    async def refused(exc: _Refused) -> Any:
        return await page("base.html", exc.message), exc.status

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Any:
        return Response(f"{exc.code} {exc.name}", status=exc.code or 500, content_type="text/plain")

    # --- static, root, sign-in ------------------------------------------
    @app.get("/static/<name>")
    async def static_file(name: str) -> Any:
        found = find_asset(name)
        if found is None:
            return Response("not found", status=404, content_type="text/plain")
        response = Response(found.body, content_type=found.content_type)
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable"
        return response

    @app.get("/")
    async def root() -> Any:
        return redirect("/admin" if admin_listener else "/portal/chat", 303)

    def signin_form(error: str = "", status: int = 200, email: str = "") -> Any:
        async def render() -> Any:
            token = secrets.token_urlsafe(24)
            nxt = request.args.get("next", "") if request.method == "GET" else ""
            if request.method == "POST":
                nxt = (await request.form).get("next", "")
            response = await page(
                "sign_in.html",
                "Sign in",
                error=error,
                signin_csrf=token,
                next=_safe_next(nxt),
                email=email,
                signup_open=cluster.settings.auth.signup_open,
            )
            response.status_code = status
            set_form_cookie(response, token, "/portal/sign-in")
            return response

        return render()

    @app.get("/portal/sign-in")
    async def sign_in_page() -> Any:
        return await signin_form()

    @app.post("/portal/sign-in")
    async def sign_in() -> Any:
        form = await request.form
        presented = form.get("csrf", "")
        cookie = request.cookies.get(_SIGNIN_COOKIE, "")
        if not cookie or not secrets.compare_digest(cookie, presented):
            return await signin_form("The sign-in form was stale; please try again.", 403)
        email = form.get("email", "")
        ttl_s = cluster.settings.auth.session_ttl
        try:
            person, token = await people.sign_in(
                email, form.get("password", ""), client(), ttl_s=ttl_s
            )
        except errors.Refused as exc:
            return await signin_form(str(exc), exc.status, email=email)
        target = _safe_next(form.get("next", "")) or (
            "/admin"
            if admin_listener or (person.staff_role and not _portal_target(form))
            else "/portal/chat"
        )
        response = redirect(target, 303)
        response.set_cookie(
            SESSION_COOKIE,
            token,
            max_age=int(ttl_s),
            httponly=True,
            samesite="Lax",
            secure=secure(),
            path="/",
        )
        response.delete_cookie(_SIGNIN_COOKIE, path="/portal/sign-in")
        return response

    @app.get("/portal/sign-up")
    async def sign_up_page() -> Any:
        if not cluster.settings.auth.signup_open:
            raise _Refused(404, "Sign-up is closed: ask an administrator for an account.")
        return await signup_form()

    def signup_form(message: str = "", error: str = "", status: int = 200) -> Any:
        async def render() -> Any:
            token = secrets.token_urlsafe(24)
            response = await page(
                "sign_up.html", "Sign up", signin_csrf=token, message=message, error=error
            )
            response.status_code = status
            set_form_cookie(response, token, "/portal/sign-up")
            return response

        return render()

    @app.post("/portal/sign-up")
    async def sign_up() -> Any:
        if not cluster.settings.auth.signup_open:
            raise _Refused(404, "Sign-up is closed: ask an administrator for an account.")
        form = await request.form
        cookie = request.cookies.get(_SIGNIN_COOKIE, "")
        if not cookie or not secrets.compare_digest(cookie, form.get("csrf", "")):
            return await signup_form(
                error="The sign-up form was stale; please try again.", status=403
            )
        try:
            await people.sign_up(form.get("email", ""), form.get("password", ""))
        except errors.InvalidInput as exc:
            return await signup_form(error=str(exc), status=400)
        return await signup_form(
            message="Thank you. If this address may have an account, it now awaits approval;"
            " you can sign in once an administrator approves it."
        )

    @app.post("/portal/sign-out")
    async def sign_out() -> Any:
        signed = await signed_in()
        await posted(signed)
        await people.sign_out(g.token)
        response = redirect("/portal/sign-in", 303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    # --- the person's pages ---------------------------------------------
    async def scopes(signed: SignedIn) -> _Scopes:
        tree = await store.list_tree()
        mine = await store.list_memberships(signed.person.id)
        return _Scopes(
            member=[p for p in tree if any(_covers(m, p) for m in mine)],
            managed=[p for p in tree if any(_covers(m, p) and m.role == "manager" for m in mine)],
        )

    async def chat_key(signed: SignedIn) -> tuple[str, KeyRecord]:
        """The session's chat key: in the first project (by path) the person
        is a member of, else personal."""
        member = (await scopes(signed)).member
        first = min(member, key=lambda p: p.path).project.id if member else None
        return await people.ensure_chat_key(signed, g.token, first)

    async def usable_models(signed: SignedIn) -> list[Any]:
        """The catalog's models the session's chat key may call, as the
        gateway decides it (the models lists along the key's path)."""
        models = sorted(cluster.models.values(), key=lambda m: m.name)
        if resolver is None or accountant is None:
            return models
        _, record = await chat_key(signed)
        path, _ = await resolver.path(record)
        return [m for m in models if accountant.allowed(path, m.name)]

    @app.get("/portal/chat")
    async def chat() -> Any:
        signed = await signed_in()
        key, _ = await chat_key(signed)
        models = [
            {"name": m.name, "max_output": m.max_output_tokens} for m in await usable_models(signed)
        ]
        return await page("chat.html", "Chat", chat_key=key, models=models)

    async def visible_keys(signed: SignedIn, found: _Scopes) -> list[KeyRecord]:
        managed = {p.project.id for p in found.managed}
        return [
            k
            for k in await store.list_keys()
            if k.name != CHAT_KEY_NAME
            and (k.owner == signed.person.email or (k.project_id in managed and not k.is_admin))
        ]

    async def keys_page(
        signed: SignedIn, made: dict[str, Any] | None = None, error: str = ""
    ) -> Any:
        found = await scopes(signed)
        paths = {p.project.id: p.path for p in await store.list_tree()}
        # The same last use as the admin API: the later of the stored value
        # and the newest usage row.
        last_used = await store.keys_last_used()
        shown = [
            {
                "id": k.id,
                "name": k.name,
                "prefix": k.prefix,
                "where": f"project {paths.get(k.project_id, '?')}" if k.project_id else "personal",
                "owner": k.owner or "—",
                "created": _when(k.created_at),
                "last_used": _when(used)
                if (used := last_used.get(k.id, k.last_used_at))
                else "never",
                "revoked": k.revoked_at is not None,
            }
            for k in reversed(await visible_keys(signed, found))
        ]
        return await page(
            "keys.html",
            "Keys",
            keys=shown,
            projects=[{"id": p.project.id, "path": p.path} for p in found.member],
            made=made,
            error=error,
        )

    @app.get("/portal/keys")
    async def keys_get() -> Any:
        return await keys_page(await signed_in())

    @app.post("/portal/keys")
    async def keys_make() -> Any:
        signed = await signed_in()
        form = await posted(signed)
        name = form.get("name", "").strip()
        where = form.get("where", "")
        email = signed.person.email
        try:
            if where:
                target = next(
                    (p for p in (await scopes(signed)).member if p.project.id == where), None
                )
                if target is None:
                    raise _Refused(404, "No such project of yours.")
                made = await keys.create(name, project=target.path)
                record = await store.get_key(made["id"])
                if record is not None:
                    await store.update_key(attrs.evolve(record, owner=email))
            else:
                made = await keys.create(name, person=email)
        except errors.InvalidInput as exc:
            return await keys_page(signed, error=str(exc))
        return await keys_page(signed, made=made)

    @app.post("/portal/keys/<key_id>/revoke")
    async def keys_revoke(key_id: str) -> Any:
        signed = await signed_in()
        await posted(signed)
        if not any(k.id == key_id for k in await visible_keys(signed, await scopes(signed))):
            raise _Refused(404, "No such key of yours.")
        try:
            await keys.revoke(key_id)
        except errors.Refused:
            pass  # already revoked
        raise _Redirect("/portal/keys")

    @app.get("/portal/connect")
    async def connect() -> Any:
        await signed_in()
        base = cluster.settings.portal.external_url.rstrip("/") or (
            f"{request.scheme}://{request.host}"
        )
        models = await usable_models(g.signed)
        model = models[0].name if models else "MODEL"
        return await page(
            "connect.html",
            "Connect your editor",
            base=base,
            model=model,
            snippets=_snippets(base, model),
        )

    async def usage_scope(signed: SignedIn) -> tuple[str, str, dict[str, Any]]:
        """(project id or "", label, rows_for kwargs); 404 for a project the
        person does not manage."""
        project = request.args.get("project", "")
        found = await scopes(signed)
        if project:
            target = next((p for p in found.managed if p.project.id == project), None)
            if target is None:
                raise _Refused(404, "No such project that you manage.")
            return project, f"Project {target.path}", {"project_id": project}
        mine = {k.id for k in await store.list_keys() if k.owner == signed.person.email}
        return "", "Your keys", {"key_ids": mine}

    def days_arg() -> int:
        try:
            days = int(request.args.get("days", "30"))
        except ValueError:
            days = 30
        return days if days in (7, 30, 90) else 30

    @app.get("/portal/usage")
    async def usage() -> Any:
        signed = await signed_in()
        project, label, where = await usage_scope(signed)
        days = days_arg()
        rows = await rows_for(store, time.time() - days * 86_400, **where)
        per_day = daily(rows, days)
        chart = bar_chart(
            [d.day for d in per_day],
            [d.prompt_tokens + d.completion_tokens for d in per_day],
            title=f"{label}: tokens per day",
        )
        return await page(
            "usage.html",
            "Usage",
            project=project,
            label=label,
            days=days,
            managed=[{"id": p.project.id, "path": p.path} for p in (await scopes(signed)).managed],
            chart=chart,
            rows=[
                {**attrs.asdict(d), "cost": money(d.cost_micros)}
                for d in reversed(per_day)
                if d.requests
            ],
            totals={
                "requests": sum(d.requests for d in per_day),
                "tokens": sum(d.prompt_tokens + d.completion_tokens for d in per_day),
                "cost": money(sum(d.cost_micros for d in per_day)),
            },
            latest=[
                {
                    "when": _when(r.created_at),
                    "model": r.served_model or r.model,
                    "status": r.status,
                    "tokens": r.prompt_tokens + r.completion_tokens,
                    "request_id": r.request_id,
                }
                for r in reversed(rows[-20:])
            ],
        )

    @app.get("/portal/usage.csv")
    async def usage_csv() -> Any:
        signed = await signed_in()
        _, _, where = await usage_scope(signed)
        rows = await rows_for(store, time.time() - days_arg() * 86_400, **where)
        response = Response(to_csv(rows), content_type="text/csv; charset=utf-8")
        response.headers["Content-Disposition"] = 'attachment; filename="llmgw-usage.csv"'
        return response

    @app.get("/portal/models")
    async def models_page() -> Any:
        signed = await signed_in()
        auth = cluster.settings.auth
        shown = []
        for m in await usable_models(signed):
            price = auth.pricing.get(m.name, auth.default_price)
            ready = len(cluster.ready_endpoints(m.name))
            shown.append(
                {
                    "name": m.name,
                    "aliases": ", ".join(m.aliases) or "—",
                    "context": m.context_length or "unknown",
                    "max_output": m.max_output_tokens or "—",
                    "price": f"{money(price.prompt_per_1k * 1000)} / {money(price.completion_per_1k * 1000)}",
                    "ready": ready,
                }
            )
        return await page("models.html", "Models", models=shown)

    # --- admin pages ------------------------------------------------------
    @app.get("/admin")
    async def admin_home() -> Any:
        signed = await signed_in()
        staff(signed)
        everyone = await store.list_people()
        shards = list(cluster.shards.values())
        counts = {
            "people": len(everyone),
            "awaiting": sum(p.state == "awaiting" for p in everyone),
            "suspended": sum(p.state == "suspended" for p in everyone),
            "projects": len(await store.list_tree()),
            "models": len(cluster.models),
            "replicas": len(shards),
            "ready": sum(s.state.value == "READY" for s in shards),
            "nodes": sum(n.connected for n in cluster.nodes.values()),
        }
        return await page("admin_home.html", "Admin", counts=counts)

    async def people_page(
        signed: SignedIn, made: dict[str, str] | None = None, error: str = ""
    ) -> Any:
        shown = []
        for person in await store.list_people():
            view = await person_view(store, person)
            view["verbs"] = {
                "awaiting": ["approve"],
                "active": ["suspend"],
                "suspended": ["reinstate"],
            }[person.state]
            shown.append(view)
        return await page(
            "admin_people.html", "People", people=shown, roles=STAFF_ROLES, made=made, error=error
        )

    @app.get("/admin/people")
    async def admin_people() -> Any:
        signed = await signed_in()
        staff(signed)
        return await people_page(signed)

    @app.post("/admin/people")
    async def admin_invite() -> Any:
        signed = await signed_in()
        form = await posted(signed)
        staff(signed, "people")
        try:
            target = await membership_target(store, {"project": form.get("project", "").strip()})
            person, password = await people.join(
                form.get("email", ""), staff_role=form.get("role", "")
            )
            if target is not None:
                await people.add_membership(
                    person.id, target[0], target[1], form.get("member_role") or "member"
                )
        except (errors.InvalidInput, errors.NotFound, errors.Refused) as exc:
            return await people_page(signed, error=str(exc))
        return await people_page(signed, made={"email": person.email, "password": password})

    @app.post("/admin/people/<person_id>/<verb>")
    async def admin_person(person_id: str, verb: str) -> Any:
        signed = await signed_in()
        form = await posted(signed)
        staff(signed, "people")
        try:
            if verb == "approve":
                await people.approve(person_id)
            elif verb == "reinstate":
                await people.set_state(person_id, "active")
            elif verb == "suspend":
                if person_id == signed.person.id:
                    raise errors.InvalidInput("You cannot suspend yourself.")
                await people.set_state(person_id, "suspended")
            elif verb == "role":
                if person_id == signed.person.id and form.get("role") != "admin":
                    raise errors.InvalidInput("You cannot drop your own admin role.")
                await people.set_role(person_id, form.get("role", ""))
            elif verb == "memberships":
                target = await membership_target(
                    store, {"project": form.get("project", "").strip()}
                )
                if target is None:
                    raise errors.InvalidInput("Name a project like Org/team/project.")
                await people.add_membership(
                    person_id, target[0], target[1], form.get("member_role") or "member"
                )
            else:
                raise _Refused(404, "No such action.")
        except (errors.InvalidInput, errors.NotFound, LastAdmin, WrongState) as exc:
            return await people_page(signed, error=str(exc))
        raise _Redirect("/admin/people")

    @app.get("/admin/tree")
    async def admin_tree() -> Any:
        signed = await signed_in()
        staff(signed)
        return await tree_page()

    async def tree_page(error: str = "") -> Any:
        spent = await store.spend_since_by_scope(_month_start())
        rows: list[dict[str, Any]] = []
        seen: set[str] = set()
        for path in await store.list_tree():
            for scope, level, name in (
                ("org", path.org, path.org.name),
                ("team", path.team, f"{path.org.name}/{path.team.name}"),
                ("project", path.project, path.path),
            ):
                if level.id in seen:
                    continue
                seen.add(level.id)
                lim = level.limits
                rows.append(
                    {
                        "scope": scope,
                        "id": level.id,
                        "path": name,
                        "rpm": lim.rpm or "—",
                        "tpm": lim.tpm or "—",
                        "day": money(lim.budget_day_micros) if lim.budget_day_micros else "—",
                        "month": money(lim.budget_month_micros) if lim.budget_month_micros else "—",
                        "spent": money(spent.get(f"{scope}:{level.id}", 0)),
                        "rpm_value": lim.rpm or "",
                        "tpm_value": lim.tpm or "",
                        "month_value": money(lim.budget_month_micros)
                        if lim.budget_month_micros
                        else "",
                    }
                )
        return await page("admin_tree.html", "Tree", rows=rows, error=error)

    @app.post("/admin/tree/<scope>/<level_id>")
    async def admin_limits(scope: str, level_id: str) -> Any:
        signed = await signed_in()
        form = await posted(signed)
        staff(signed, "limits")
        doc: dict[str, Any] = {}
        try:
            for name in ("rpm", "tpm"):
                value = form.get(name, "").strip()
                # Digits become a number; anything else goes as text, which
                # the admin API's own check refuses with its own message.
                doc[name] = (
                    (int(value) if value.isascii() and value.isdigit() else value)
                    if value
                    else None
                )
            budget = form.get("budget_month", "").strip()
            doc["budget_month"] = budget or None
            await keys.set_limits(scope, level_id, doc)
        except (errors.InvalidInput, errors.NotFound) as exc:
            return await tree_page(error=str(exc))
        raise _Redirect("/admin/tree")

    @app.get("/admin/models")
    async def admin_models() -> Any:
        signed = await signed_in()
        staff(signed)
        models = [
            [
                m.name,
                sum(p.replicas for p in m.profiles),
                "on demand" if m.on_demand else ("stopped" if m.stopped else "kept running"),
                m.context_length or "—",
                ", ".join(m.aliases) or "—",
            ]
            for m in sorted(cluster.models.values(), key=lambda m: m.name)
        ]
        replicas = [
            [
                s.replica_id,
                s.model,
                s.node_id,
                s.state.value,
                s.reason or s.progress or "—",
                s.compute or "—",
            ]
            for s in sorted(cluster.shards.values(), key=lambda s: s.replica_id)
        ]
        return await page(
            "admin_table.html",
            "Models and replicas",
            tables=[
                {
                    "title": "Models",
                    "headers": ["Model", "Replicas wanted", "Serving", "Context", "Aliases"],
                    "rows": models,
                },
                {
                    "title": "Replicas",
                    "headers": ["Replica", "Model", "Node", "State", "Reason", "Runs on"],
                    "rows": replicas,
                },
            ],
        )

    @app.get("/admin/nodes")
    async def admin_nodes() -> Any:
        signed = await signed_in()
        staff(signed)
        rows = [
            [
                n.node_id,
                n.address,
                "connected" if n.connected else "disconnected",
                f"{n.load_1m:.2f}",
                f"{n.memory_available_mb} MB",
                len(n.gpus),
                ", ".join(n.engines) or "—",
                n.agent_version,
            ]
            for n in sorted(cluster.nodes.values(), key=lambda n: n.node_id)
        ]
        headers = [
            "Node",
            "Address",
            "Link",
            "Load (1 min)",
            "Free memory",
            "GPUs",
            "Engines",
            "Agent",
        ]
        return await page(
            "admin_table.html", "Nodes", tables=[{"title": "", "headers": headers, "rows": rows}]
        )

    @app.get("/admin/usage")
    async def admin_usage() -> Any:
        signed = await signed_in()
        staff(signed)
        since = time.time() - 30 * 86_400
        names = {("project", p.project.id): p.path for p in await store.list_tree()}
        for p in await store.list_tree():
            names[("team", p.team.id)] = f"{p.org.name}/{p.team.name}"
            names[("org", p.org.id)] = p.org.name
        tables = []
        for by in ("org", "team", "project", "model"):
            sums = await store.usage_summary(by, since)
            labels = [names.get((by, s.group), s.group or "(none)") for s in sums]
            tables.append(
                {
                    "title": f"By {by}, last 30 days",
                    "chart": bar_chart(
                        labels[:20],
                        [s.prompt_tokens + s.completion_tokens for s in sums[:20]],
                        title=f"tokens by {by}",
                    )
                    if sums
                    else "",
                    "headers": [
                        by.capitalize(),
                        "Requests",
                        "Errors",
                        "Prompt tokens",
                        "Completion tokens",
                        "Spend",
                    ],
                    "rows": [
                        [
                            label,
                            s.requests,
                            s.errors,
                            s.prompt_tokens,
                            s.completion_tokens,
                            money(s.cost_micros),
                        ]
                        for label, s in zip(labels, sums, strict=True)
                    ],
                }
            )
        return await page("admin_table.html", "Usage by scope", tables=tables)

    return app


def _covers(m: Membership, p: ProjectPath) -> bool:
    return (
        (m.scope == "project" and m.scope_id == p.project.id)
        or (m.scope == "team" and m.scope_id == p.team.id)
        or (m.scope == "org" and m.scope_id == p.org.id)
    )


def _safe_next(target: str) -> str:
    """``target`` when it is a path on this site (never another host)."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return ""
    if "\\" in target:
        return ""
    return target


def _portal_target(form: Mapping[str, str]) -> bool:
    return form.get("next", "").startswith("/portal/")


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(at)) if at else "—"


def _month_start() -> float:
    now = time.gmtime()
    return float(time.mktime((now.tm_year, now.tm_mon, 1, 0, 0, 0, 0, 0, 0)) - time.timezone)


def _snippets(base: str, model: str) -> list[dict[str, str]]:
    v1 = f"{base}/v1"
    return [
        {
            "title": "OpenAI SDK (Python)",
            "text": (
                "from openai import OpenAI\n\n"
                f'client = OpenAI(base_url="{v1}", api_key=os.environ["LLMGW_KEY"])\n'
                "answer = client.chat.completions.create(\n"
                f'    model="{model}", messages=[{{"role": "user", "content": "Hello"}}]\n'
                ")\nprint(answer.choices[0].message.content)"
            ),
        },
        {
            "title": "Anthropic SDK (Python)",
            "text": (
                "from anthropic import Anthropic\n\n"
                f'client = Anthropic(base_url="{base}", api_key=os.environ["LLMGW_KEY"])\n'
                "message = client.messages.create(\n"
                f'    model="{model}", max_tokens=256, messages=[{{"role": "user", "content": "Hello"}}]\n'
                ")\nprint(message.content[0].text)"
            ),
        },
        {
            "title": "curl",
            "text": (
                f"curl {v1}/chat/completions \\\n"
                '  -H "Authorization: Bearer $LLMGW_KEY" -H "Content-Type: application/json" \\\n'
                f'  -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}]}}\''
            ),
        },
        {
            "title": "Environment (most tools: Aider, Cline, Continue, the OpenAI CLI)",
            "text": f"export OPENAI_BASE_URL={v1}\nexport OPENAI_API_KEY=$LLMGW_KEY\n"
            f"export ANTHROPIC_BASE_URL={base}\nexport ANTHROPIC_API_KEY=$LLMGW_KEY",
        },
        {
            "title": "Continue (config.yaml)",
            "text": (
                "models:\n"
                f"  - name: llmgw {model}\n    provider: openai\n    model: {model}\n"
                f"    apiBase: {v1}\n    apiKey: ${{{{ secrets.LLMGW_KEY }}}}"
            ),
        },
        {
            "title": "Claude Code",
            "text": f"export ANTHROPIC_BASE_URL={base}\nexport ANTHROPIC_AUTH_TOKEN=$LLMGW_KEY\n"
            f"claude --model {model}",
        },
    ]
