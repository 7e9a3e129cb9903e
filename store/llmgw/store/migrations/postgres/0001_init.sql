-- 0001: the whole schema of SQLite's 0001 to 0008 at once: keys and the
-- tenancy tree, usage and its roll-ups, the catalog, settings and their
-- history, secrets, leases, node certificates and join tokens.
--
-- Rules for every migration file here (see llmgw/store/postgres.py): it is
-- named NNNN_what.sql, runs inside one transaction together with its row in
-- schema_migrations (so no BEGIN or COMMIT here), and never drops data
-- silently. Times are UTC epoch seconds (DOUBLE PRECISION); durations say _ms.
-- JSON is kept as text, written and read by the store as on SQLite. Names
-- and ids that listings are ordered by compare byte by byte (COLLATE "C"),
-- as on SQLite, whatever the database's locale.

CREATE TABLE secrets (
    name        TEXT PRIMARY KEY,
    value       BYTEA NOT NULL,
    created_at  DOUBLE PRECISION NOT NULL
);

-- limits columns hold JSON objects (rpm, tpm, budget_day_micros,
-- budget_month_micros, models); a missing member is not limited there.
CREATE TABLE orgs (
    id          TEXT PRIMARY KEY,
    name        TEXT COLLATE "C" NOT NULL UNIQUE,
    limits      TEXT NOT NULL DEFAULT '{}',
    created_at  DOUBLE PRECISION NOT NULL
);

CREATE TABLE teams (
    id          TEXT PRIMARY KEY,
    org_id      TEXT NOT NULL REFERENCES orgs (id),
    name        TEXT COLLATE "C" NOT NULL,
    limits      TEXT NOT NULL DEFAULT '{}',
    created_at  DOUBLE PRECISION NOT NULL,
    UNIQUE (org_id, name)
);

CREATE TABLE projects (
    id          TEXT PRIMARY KEY,
    team_id     TEXT NOT NULL REFERENCES teams (id),
    name        TEXT COLLATE "C" NOT NULL,
    limits      TEXT NOT NULL DEFAULT '{}',
    created_at  DOUBLE PRECISION NOT NULL,
    UNIQUE (team_id, name)
);

-- seq keeps the order keys were kept in (SQLite's rowid).
CREATE TABLE keys (
    id            TEXT PRIMARY KEY,
    seq           BIGINT GENERATED ALWAYS AS IDENTITY,
    name          TEXT NOT NULL,
    key_hash      TEXT NOT NULL UNIQUE,
    prefix        TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL,
    is_admin      BOOLEAN NOT NULL DEFAULT false,
    revoked_at    DOUBLE PRECISION,
    expires_at    DOUBLE PRECISION,
    project_id    TEXT REFERENCES projects (id),
    band          TEXT NOT NULL DEFAULT '',
    limits        TEXT NOT NULL DEFAULT '{}',
    last_used_at  DOUBLE PRECISION,
    owner         TEXT NOT NULL DEFAULT ''
);
CREATE INDEX keys_project_id ON keys (project_id);
CREATE INDEX keys_owner ON keys (owner) WHERE owner != '';

-- One row per finished or failed client request. Never prompt or answer text.
-- seq keeps the order rows were kept in (SQLite's rowid).
CREATE TABLE usage (
    request_id         TEXT COLLATE "C" PRIMARY KEY,
    seq                BIGINT GENERATED ALWAYS AS IDENTITY,
    created_at         DOUBLE PRECISION NOT NULL,
    key_id             TEXT NOT NULL,
    model              TEXT NOT NULL,
    status             INTEGER NOT NULL,
    prompt_tokens      BIGINT NOT NULL DEFAULT 0,
    cached_tokens      BIGINT NOT NULL DEFAULT 0,
    completion_tokens  BIGINT NOT NULL DEFAULT 0,
    duration_ms        DOUBLE PRECISION NOT NULL DEFAULT 0,
    ttft_ms            DOUBLE PRECISION,
    replica_id         TEXT NOT NULL DEFAULT '',
    stream             BOOLEAN NOT NULL DEFAULT false,
    endpoint           TEXT NOT NULL DEFAULT '',
    project_id         TEXT NOT NULL DEFAULT '',
    team_id            TEXT NOT NULL DEFAULT '',
    org_id             TEXT NOT NULL DEFAULT '',
    served_model       TEXT NOT NULL DEFAULT '',
    images             BIGINT NOT NULL DEFAULT 0,
    meshes             BIGINT NOT NULL DEFAULT 0,
    cost_micros        BIGINT NOT NULL DEFAULT 0,
    cache_hit          BOOLEAN NOT NULL DEFAULT false
);
-- (created_at, request_id): time ranges, and the export's paging order.
CREATE INDEX usage_created_at ON usage (created_at, request_id);
CREATE INDEX usage_key_id ON usage (key_id, created_at);
CREATE INDEX usage_model ON usage (model, created_at);
CREATE INDEX usage_project_id ON usage (project_id, created_at);

-- Usage summed per hour, UTC day and calendar month (the period's start in
-- epoch seconds), key, model (served_model, else model) and tree place.
CREATE TABLE usage_hourly (
    hour               BIGINT NOT NULL,
    key_id             TEXT NOT NULL,
    model              TEXT NOT NULL,
    project_id         TEXT NOT NULL DEFAULT '',
    team_id            TEXT NOT NULL DEFAULT '',
    org_id             TEXT NOT NULL DEFAULT '',
    requests           BIGINT NOT NULL DEFAULT 0,
    prompt_tokens      BIGINT NOT NULL DEFAULT 0,
    cached_tokens      BIGINT NOT NULL DEFAULT 0,
    completion_tokens  BIGINT NOT NULL DEFAULT 0,
    cost_micros        BIGINT NOT NULL DEFAULT 0,
    errors             BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (hour, key_id, model, project_id, team_id, org_id)
);

CREATE TABLE usage_daily (
    day                BIGINT NOT NULL,
    key_id             TEXT NOT NULL,
    model              TEXT NOT NULL,
    project_id         TEXT NOT NULL DEFAULT '',
    team_id            TEXT NOT NULL DEFAULT '',
    org_id             TEXT NOT NULL DEFAULT '',
    requests           BIGINT NOT NULL DEFAULT 0,
    prompt_tokens      BIGINT NOT NULL DEFAULT 0,
    cached_tokens      BIGINT NOT NULL DEFAULT 0,
    completion_tokens  BIGINT NOT NULL DEFAULT 0,
    cost_micros        BIGINT NOT NULL DEFAULT 0,
    errors             BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (day, key_id, model, project_id, team_id, org_id)
);

CREATE TABLE usage_monthly (
    month              BIGINT NOT NULL,
    key_id             TEXT NOT NULL,
    model              TEXT NOT NULL,
    project_id         TEXT NOT NULL DEFAULT '',
    team_id            TEXT NOT NULL DEFAULT '',
    org_id             TEXT NOT NULL DEFAULT '',
    requests           BIGINT NOT NULL DEFAULT 0,
    prompt_tokens      BIGINT NOT NULL DEFAULT 0,
    cached_tokens      BIGINT NOT NULL DEFAULT 0,
    completion_tokens  BIGINT NOT NULL DEFAULT 0,
    cost_micros        BIGINT NOT NULL DEFAULT 0,
    errors             BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (month, key_id, model, project_id, team_id, org_id)
);

-- The pruning horizon: raw rows older than pruned_before (an hour boundary)
-- may be gone, their sums are in the roll-ups; NULL = nothing pruned yet.
-- The one row always exists, so usage writers can lock it (FOR SHARE)
-- against a concurrent prune.
CREATE TABLE usage_retention (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    pruned_before  DOUBLE PRECISION
);
INSERT INTO usage_retention (id, pruned_before) VALUES (1, NULL);

-- The older columns (engine … created_at) are filled from the first
-- profile as on SQLite; spec holds the whole catalog entry as JSON.
CREATE TABLE models (
    name            TEXT COLLATE "C" PRIMARY KEY,
    engine          TEXT NOT NULL,
    source          TEXT NOT NULL DEFAULT '',
    replicas        INTEGER NOT NULL DEFAULT 1,
    context_tokens  INTEGER NOT NULL,
    slots           INTEGER NOT NULL,
    cpu_cores       INTEGER NOT NULL DEFAULT 0,
    args            TEXT NOT NULL DEFAULT '[]',
    env             TEXT NOT NULL DEFAULT '{}',
    sha256          TEXT NOT NULL DEFAULT '',
    created_at      DOUBLE PRECISION NOT NULL DEFAULT 0,
    spec            TEXT NOT NULL DEFAULT ''
);

-- value is JSON text.
CREATE TABLE settings (
    key         TEXT PRIMARY KEY,
    value       TEXT NOT NULL,
    updated_at  DOUBLE PRECISION NOT NULL
);

CREATE TABLE settings_history (
    version     BIGINT PRIMARY KEY,
    document    TEXT NOT NULL,
    changed_at  DOUBLE PRECISION NOT NULL,
    actor       TEXT NOT NULL DEFAULT '',
    note        TEXT NOT NULL DEFAULT ''
);

-- A released lease keeps its row (expires_at = 0) so the epoch never goes back.
CREATE TABLE leases (
    name        TEXT PRIMARY KEY,
    holder      TEXT NOT NULL,
    epoch       BIGINT NOT NULL,
    expires_at  DOUBLE PRECISION NOT NULL
);

CREATE TABLE node_certificates (
    serial      TEXT COLLATE "C" PRIMARY KEY,      -- lower-case hex
    node_id     TEXT NOT NULL,         -- the certificate's CN
    issued_at   DOUBLE PRECISION NOT NULL,
    not_after   DOUBLE PRECISION NOT NULL,
    revoked_at  DOUBLE PRECISION       -- NULL while valid
);
CREATE INDEX node_certificates_node_id ON node_certificates (node_id, issued_at);

CREATE TABLE join_tokens (
    token_hash  TEXT PRIMARY KEY,      -- hex SHA-256 of the token
    created_at  DOUBLE PRECISION NOT NULL,
    expires_at  DOUBLE PRECISION NOT NULL,
    node_id     TEXT NOT NULL DEFAULT '',   -- '' = the joining node chooses
    labels      TEXT NOT NULL DEFAULT '{}', -- JSON object of strings
    used_at     DOUBLE PRECISION       -- NULL until used (once)
);
