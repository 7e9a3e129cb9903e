-- 0003: the guard events: one row per rule that matched in a request, with
-- the direction and the action taken (never the matched text, never a
-- header). Written with the request's usage row; pruned with it.

CREATE TABLE guard_events (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    direction TEXT NOT NULL,
    rule TEXT NOT NULL,
    action TEXT NOT NULL
);
CREATE INDEX guard_events_created_at ON guard_events (created_at);
CREATE INDEX guard_events_request_id ON guard_events (request_id);
CREATE INDEX guard_events_rule ON guard_events (rule, created_at);
