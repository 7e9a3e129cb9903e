-- 0003: personal keys. A key belongs to a project, or to a person: `owner`
-- holds the person's sign-in address for a personal key ('' otherwise).
ALTER TABLE keys ADD COLUMN owner TEXT NOT NULL DEFAULT '';
CREATE INDEX keys_owner ON keys (owner) WHERE owner != '';
