-- 0002: the tenancy tree (orgs → teams → projects), keys in projects, usage
-- with its place in the tree and its cost, and hourly usage roll-ups.
--
-- Nothing is dropped but one index, rebuilt at once with one more column.
-- Existing keys get project_id NULL (they keep working, outside the tree);
-- existing usage rows get empty tree ids and zero cost, and are summed into
-- usage_hourly so the roll-ups cover them too.
--
-- limits columns hold JSON objects (rpm, tpm, budget_day_micros,
-- budget_month_micros, models); a missing member is not limited there.

CREATE TABLE orgs (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    limits      TEXT NOT NULL DEFAULT '{}',
    created_at  REAL NOT NULL
);

CREATE TABLE teams (
    id          TEXT PRIMARY KEY,
    org_id      TEXT NOT NULL REFERENCES orgs (id),
    name        TEXT NOT NULL,
    limits      TEXT NOT NULL DEFAULT '{}',
    created_at  REAL NOT NULL,
    UNIQUE (org_id, name)
);

CREATE TABLE projects (
    id          TEXT PRIMARY KEY,
    team_id     TEXT NOT NULL REFERENCES teams (id),
    name        TEXT NOT NULL,
    limits      TEXT NOT NULL DEFAULT '{}',
    created_at  REAL NOT NULL,
    UNIQUE (team_id, name)
);

ALTER TABLE keys ADD COLUMN project_id TEXT REFERENCES projects (id);
ALTER TABLE keys ADD COLUMN band TEXT NOT NULL DEFAULT '';
ALTER TABLE keys ADD COLUMN limits TEXT NOT NULL DEFAULT '{}';
ALTER TABLE keys ADD COLUMN last_used_at REAL;
CREATE INDEX keys_project_id ON keys (project_id);

ALTER TABLE usage ADD COLUMN project_id TEXT NOT NULL DEFAULT '';
ALTER TABLE usage ADD COLUMN team_id TEXT NOT NULL DEFAULT '';
ALTER TABLE usage ADD COLUMN org_id TEXT NOT NULL DEFAULT '';
ALTER TABLE usage ADD COLUMN served_model TEXT NOT NULL DEFAULT '';
ALTER TABLE usage ADD COLUMN images INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage ADD COLUMN meshes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage ADD COLUMN cost_micros INTEGER NOT NULL DEFAULT 0;
CREATE INDEX usage_project_id ON usage (project_id, created_at);
-- (created_at, request_id): time ranges, and the export's paging order.
DROP INDEX usage_created_at;
CREATE INDEX usage_created_at ON usage (created_at, request_id);

-- Usage summed per hour (hour = created_at floored to a multiple of 3600),
-- key and model (served_model, else model). The tree ids are in the key too,
-- so a key moved to another project later keeps its old spend where it was.
-- Without rowid: the table is its own index, ordered by hour first.
CREATE TABLE usage_hourly (
    hour               INTEGER NOT NULL,
    key_id             TEXT NOT NULL,
    model              TEXT NOT NULL,
    project_id         TEXT NOT NULL DEFAULT '',
    team_id            TEXT NOT NULL DEFAULT '',
    org_id             TEXT NOT NULL DEFAULT '',
    requests           INTEGER NOT NULL DEFAULT 0,
    prompt_tokens      INTEGER NOT NULL DEFAULT 0,
    cached_tokens      INTEGER NOT NULL DEFAULT 0,
    completion_tokens  INTEGER NOT NULL DEFAULT 0,
    cost_micros        INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hour, key_id, model, project_id, team_id, org_id)
) WITHOUT ROWID;

-- The rows kept so far. floor(created_at / 3600) * 3600 without floor(),
-- which not every SQLite build has: truncate, then step down one hour when
-- truncation went up (negative times, or a quotient rounded up).
INSERT INTO usage_hourly (hour, key_id, model, project_id, team_id, org_id, requests,
                          prompt_tokens, cached_tokens, completion_tokens, cost_micros)
SELECT hour, key_id, model, project_id, team_id, org_id, count(*), sum(prompt_tokens),
       sum(cached_tokens), sum(completion_tokens), sum(cost_micros)
FROM (
    SELECT (CAST(created_at / 3600 AS INTEGER)
            - (created_at < CAST(created_at / 3600 AS INTEGER) * 3600)) * 3600 AS hour,
           key_id, CASE WHEN served_model != '' THEN served_model ELSE model END AS model,
           project_id, team_id, org_id, prompt_tokens, cached_tokens, completion_tokens,
           cost_micros
    FROM usage
)
GROUP BY hour, key_id, model, project_id, team_id, org_id;
