-- 0005: the cluster settings document, versioned. Each change is a new row
-- holding the whole document (JSON); the row with the highest version is
-- the live one, and the others are its history and audit (who, why).
-- Control planes poll MAX(version) each second.

CREATE TABLE settings_history (
    version     INTEGER PRIMARY KEY,
    document    TEXT NOT NULL,
    changed_at  REAL NOT NULL,
    actor       TEXT NOT NULL DEFAULT '',
    note        TEXT NOT NULL DEFAULT ''
);
