-- 0004: the whole catalog entry as one JSON document (profiles, aliases,
-- scaling, outside provider, …). The older columns stay, filled from the
-- first profile, so a downgrade still reads something sensible.

ALTER TABLE models ADD COLUMN spec TEXT NOT NULL DEFAULT '';
