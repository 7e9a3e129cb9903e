-- 0007: usage kept for years. Raw rows are pruned after
-- auth.usage_retain_days while their sums stay: the hourly roll-ups count
-- errors too, daily and monthly roll-ups (the same sums per UTC day and
-- calendar month) let a year be summed from a few rows per key and model,
-- and usage_retention remembers how far raw rows may have been pruned.
--
-- Nothing is dropped. No raw row was ever pruned before this version, so the
-- errors of the existing hourly roll-ups are counted from the raw rows, and
-- the daily roll-ups are summed from the hourly ones, the monthly ones from
-- the daily ones.

ALTER TABLE usage_hourly ADD COLUMN errors INTEGER NOT NULL DEFAULT 0;

-- An error is a row with status 400 or more. The hour is floored as in 0002.
INSERT INTO usage_hourly (hour, key_id, model, project_id, team_id, org_id, errors)
SELECT hour, key_id, model, project_id, team_id, org_id, count(*)
FROM (
    SELECT (CAST(created_at / 3600 AS INTEGER)
            - (created_at < CAST(created_at / 3600 AS INTEGER) * 3600)) * 3600 AS hour,
           key_id, CASE WHEN served_model != '' THEN served_model ELSE model END AS model,
           project_id, team_id, org_id
    FROM usage
    WHERE status >= 400
)
WHERE true
GROUP BY hour, key_id, model, project_id, team_id, org_id
ON CONFLICT (hour, key_id, model, project_id, team_id, org_id) DO UPDATE SET
    errors = excluded.errors;

-- The hourly roll-ups summed per UTC day (day = hour floored to a multiple
-- of 86400), with the same key. Without rowid: ordered by day first.
CREATE TABLE usage_daily (
    day                INTEGER NOT NULL,
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
    errors             INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (day, key_id, model, project_id, team_id, org_id)
) WITHOUT ROWID;

-- hour is an integer: its day is hour minus its (never negative) remainder.
INSERT INTO usage_daily (day, key_id, model, project_id, team_id, org_id, requests,
                         prompt_tokens, cached_tokens, completion_tokens, cost_micros, errors)
SELECT hour - ((hour % 86400) + 86400) % 86400 AS day, key_id, model, project_id, team_id,
       org_id, sum(requests), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens),
       sum(cost_micros), sum(errors)
FROM usage_hourly
GROUP BY day, key_id, model, project_id, team_id, org_id;

-- The daily roll-ups summed per UTC calendar month (month = the epoch
-- seconds of its first day), with the same key.
CREATE TABLE usage_monthly (
    month              INTEGER NOT NULL,
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
    errors             INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (month, key_id, model, project_id, team_id, org_id)
) WITHOUT ROWID;

INSERT INTO usage_monthly (month, key_id, model, project_id, team_id, org_id, requests,
                           prompt_tokens, cached_tokens, completion_tokens, cost_micros, errors)
SELECT CAST(strftime('%s', day, 'unixepoch', 'start of month') AS INTEGER) AS month, key_id,
       model, project_id, team_id, org_id, sum(requests), sum(prompt_tokens),
       sum(cached_tokens), sum(completion_tokens), sum(cost_micros), sum(errors)
FROM usage_daily
GROUP BY month, key_id, model, project_id, team_id, org_id;

-- One row once raw rows were first pruned: raw rows older than
-- pruned_before (UTC epoch s, an hour boundary) may be gone, their sums are
-- in the roll-ups. It only moves forward.
CREATE TABLE usage_retention (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    pruned_before  REAL NOT NULL
);
