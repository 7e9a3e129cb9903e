-- 0008: node identity. The certificates the cluster CA issued to nodes
-- (by serial, so a revoked one is refused on the agents' port) and the
-- one-time join tokens of join codes, kept only as their SHA-256.

CREATE TABLE node_certificates (
    serial      TEXT PRIMARY KEY,      -- lower-case hex
    node_id     TEXT NOT NULL,         -- the certificate's CN
    issued_at   REAL NOT NULL,
    not_after   REAL NOT NULL,
    revoked_at  REAL                   -- NULL while valid
);

CREATE INDEX node_certificates_node_id ON node_certificates (node_id, issued_at);

CREATE TABLE join_tokens (
    token_hash  TEXT PRIMARY KEY,      -- hex SHA-256 of the token
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    node_id     TEXT NOT NULL DEFAULT '',   -- '' = the joining node chooses
    labels      TEXT NOT NULL DEFAULT '{}', -- JSON object of strings
    used_at     REAL                   -- NULL until used (once)
);
