-- 0002: usage rows say what the guardrails found: the rule ids (comma
-- separated, never the matched text), the strictest action taken, and the
-- time spent guarding.

ALTER TABLE usage ADD COLUMN guard_rules TEXT NOT NULL DEFAULT '';
ALTER TABLE usage ADD COLUMN guard_action TEXT NOT NULL DEFAULT '';
ALTER TABLE usage ADD COLUMN guard_ms DOUBLE PRECISION NOT NULL DEFAULT 0;
