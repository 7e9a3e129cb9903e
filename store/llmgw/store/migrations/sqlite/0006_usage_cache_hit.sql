-- 0006: usage rows say whether the answer came from the exact answer cache
-- (the store holds the project setting and the hit flag, never the answer).

ALTER TABLE usage ADD COLUMN cache_hit INTEGER NOT NULL DEFAULT 0;
