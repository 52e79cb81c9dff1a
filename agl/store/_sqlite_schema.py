"""The SQLite schema: one JSON document per object, plus the columns queries filter and sort on."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    pos INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    mode TEXT,
    group_id TEXT,
    updated_at REAL NOT NULL,
    queue_pos INTEGER,
    next_seq INTEGER NOT NULL DEFAULT 1,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts(queue_pos) WHERE queue_pos IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts(status, pos);
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts(group_id);
CREATE INDEX IF NOT EXISTS rollouts_updated ON rollouts(updated_at, rollout_id);
CREATE TABLE IF NOT EXISTS attempts (
    pos INTEGER PRIMARY KEY AUTOINCREMENT,
    attempt_id TEXT NOT NULL UNIQUE,
    rollout_id TEXT NOT NULL REFERENCES rollouts(rollout_id),
    status TEXT NOT NULL,
    worker_id TEXT,
    live INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_rollout ON attempts(rollout_id, pos);
CREATE INDEX IF NOT EXISTS attempts_live ON attempts(live) WHERE live=1;
CREATE TABLE IF NOT EXISTS spans (
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    sequence_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    size INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (rollout_id, attempt_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_order ON spans(rollout_id, sequence_id, span_id);
CREATE TABLE IF NOT EXISTS resources (
    version INTEGER PRIMARY KEY,
    resources_id TEXT NOT NULL UNIQUE,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    status TEXT NOT NULL DEFAULT 'idle',
    last_heartbeat_at REAL,
    current_rollout_id TEXT,
    current_attempt_id TEXT,
    host TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters (name, value) VALUES ('queue', 0), ('resources', 0), ('spans', 0), ('span_bytes', 0);
"""
