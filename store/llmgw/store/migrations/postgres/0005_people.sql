-- 0005: people (sign-in accounts), their memberships in the tenancy tree,
-- and their portal sessions (docs/portal.md).
--
-- email is stored lower-cased; password_hash is an argon2id PHC string, or
-- begins with '!' for an account with no local password. state is one of
-- 'awaiting', 'active', 'suspended'; staff_role '' (none), 'viewer',
-- 'operator', 'billing' or 'admin'. A session is kept by the SHA-256 hash of
-- its token only.

CREATE TABLE people (
    id             TEXT PRIMARY KEY,
    email          TEXT NOT NULL UNIQUE,
    name           TEXT NOT NULL DEFAULT '',
    password_hash  TEXT NOT NULL DEFAULT '!',
    state          TEXT NOT NULL DEFAULT 'active',
    staff_role     TEXT NOT NULL DEFAULT '',
    created_at     DOUBLE PRECISION NOT NULL
);

CREATE TABLE memberships (
    person_id  TEXT NOT NULL REFERENCES people (id) ON DELETE CASCADE,
    scope      TEXT NOT NULL,
    scope_id   TEXT NOT NULL,
    role       TEXT NOT NULL DEFAULT 'member',
    PRIMARY KEY (person_id, scope, scope_id)
);
CREATE INDEX memberships_scope ON memberships (scope, scope_id);

CREATE TABLE sessions (
    token_hash  TEXT PRIMARY KEY,
    person_id   TEXT NOT NULL REFERENCES people (id) ON DELETE CASCADE,
    created_at  DOUBLE PRECISION NOT NULL,
    expires_at  DOUBLE PRECISION NOT NULL,
    client      TEXT NOT NULL DEFAULT ''
);
CREATE INDEX sessions_person_id ON sessions (person_id);
