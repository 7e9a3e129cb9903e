-- 0001: the first schema: keys, usage, models, settings, secrets, leases.
--
-- Rules for every migration file here (see llmgw/store/_sqlite_schema.py):
-- it is named NNNN_what.sql, runs inside one transaction together with its
-- row in schema_migrations (so no BEGIN or COMMIT here), and never drops
-- data silently. Times are UTC epoch seconds (REAL); durations say _ms.

CREATE TABLE keys (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    key_hash    TEXT NOT NULL UNIQUE,
    prefix      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    is_admin    INTEGER NOT NULL DEFAULT 0,
    revoked_at  REAL,
    expires_at  REAL
);

-- One row per finished or failed client request. Never prompt or answer text.
CREATE TABLE usage (
    request_id         TEXT PRIMARY KEY,
    created_at         REAL NOT NULL,
    key_id             TEXT NOT NULL,
    model              TEXT NOT NULL,
    status             INTEGER NOT NULL,
    prompt_tokens      INTEGER NOT NULL DEFAULT 0,
    cached_tokens      INTEGER NOT NULL DEFAULT 0,
    completion_tokens  INTEGER NOT NULL DEFAULT 0,
    duration_ms        REAL NOT NULL DEFAULT 0,
    ttft_ms            REAL,
    replica_id         TEXT NOT NULL DEFAULT '',
    stream             INTEGER NOT NULL DEFAULT 0,
    endpoint           TEXT NOT NULL DEFAULT ''
);
CREATE INDEX usage_created_at ON usage (created_at);
CREATE INDEX usage_key_id ON usage (key_id, created_at);
CREATE INDEX usage_model ON usage (model, created_at);

-- args is a JSON array of strings, env a JSON object of strings.
CREATE TABLE models (
    name            TEXT PRIMARY KEY,
    engine          TEXT NOT NULL,
    source          TEXT NOT NULL DEFAULT '',
    replicas        INTEGER NOT NULL DEFAULT 1,
    context_tokens  INTEGER NOT NULL,
    slots           INTEGER NOT NULL,
    cpu_cores       INTEGER NOT NULL DEFAULT 0,
    args            TEXT NOT NULL DEFAULT '[]',
    env             TEXT NOT NULL DEFAULT '{}',
    sha256          TEXT NOT NULL DEFAULT '',
    created_at      REAL NOT NULL DEFAULT 0
);

-- value is JSON text.
CREATE TABLE settings (
    key         TEXT PRIMARY KEY,
    value       TEXT NOT NULL,
    updated_at  REAL NOT NULL
);

CREATE TABLE secrets (
    name        TEXT PRIMARY KEY,
    value       BLOB NOT NULL,
    created_at  REAL NOT NULL
);

-- A released lease keeps its row (expires_at = 0) so the epoch never goes back.
CREATE TABLE leases (
    name        TEXT PRIMARY KEY,
    holder      TEXT NOT NULL,
    epoch       INTEGER NOT NULL,
    expires_at  REAL NOT NULL
);
