-- The tables and indexes of the original migration 074, unchanged, so that a database where 074
-- was applied statement by statement is adopted as it stands. 0003 repairs and extends them.
-- Task queue table
CREATE TABLE IF NOT EXISTS worker_tasks (
  id SERIAL PRIMARY KEY,

  -- Task identification
  role VARCHAR(50) NOT NULL,           -- store_discovery, entry_point_discovery, product_discovery, product_resync, analytics_refresh
  dispensary_id INTEGER REFERENCES dispensaries(id) ON DELETE CASCADE,
  platform VARCHAR(20),                 -- dutchie, jane, treez, etc.

  -- Task state
  status VARCHAR(20) NOT NULL DEFAULT 'pending',
  priority INTEGER DEFAULT 0,           -- Higher = more urgent

  -- Scheduling
  scheduled_for TIMESTAMPTZ,            -- For batch scheduling (e.g., every 4 hours)

  -- Ownership
  worker_id VARCHAR(100),               -- Pod name or worker ID
  claimed_at TIMESTAMPTZ,
  started_at TIMESTAMPTZ,
  completed_at TIMESTAMPTZ,
  last_heartbeat_at TIMESTAMPTZ,

  -- Results
  result JSONB,                         -- Task output data
  error_message TEXT,
  retry_count INTEGER DEFAULT 0,
  max_retries INTEGER DEFAULT 3,

  -- Metadata
  created_at TIMESTAMPTZ DEFAULT NOW(),
  updated_at TIMESTAMPTZ DEFAULT NOW(),

  -- Constraints
  CONSTRAINT valid_status CHECK (status IN ('pending', 'claimed', 'running', 'completed', 'failed', 'stale'))
);

-- Indexes for efficient task claiming
CREATE INDEX IF NOT EXISTS idx_worker_tasks_pending
  ON worker_tasks(role, priority DESC, created_at ASC)
  WHERE status = 'pending';

CREATE INDEX IF NOT EXISTS idx_worker_tasks_claimed
  ON worker_tasks(worker_id, claimed_at)
  WHERE status = 'claimed';

CREATE INDEX IF NOT EXISTS idx_worker_tasks_running
  ON worker_tasks(worker_id, last_heartbeat_at)
  WHERE status = 'running';

CREATE INDEX IF NOT EXISTS idx_worker_tasks_dispensary
  ON worker_tasks(dispensary_id)
  WHERE dispensary_id IS NOT NULL;

CREATE INDEX IF NOT EXISTS idx_worker_tasks_scheduled
  ON worker_tasks(scheduled_for)
  WHERE status = 'pending' AND scheduled_for IS NOT NULL;

CREATE INDEX IF NOT EXISTS idx_worker_tasks_history
  ON worker_tasks(role, completed_at DESC)
  WHERE status IN ('completed', 'failed');

-- Partial unique index to prevent duplicate active tasks per store
-- Only one task can be claimed/running for a given dispensary at a time
CREATE UNIQUE INDEX IF NOT EXISTS idx_worker_tasks_unique_active_store
  ON worker_tasks(dispensary_id)
  WHERE status IN ('claimed', 'running') AND dispensary_id IS NOT NULL;

-- Worker registration table (tracks active workers)
CREATE TABLE IF NOT EXISTS worker_registry (
  id SERIAL PRIMARY KEY,
  worker_id VARCHAR(100) UNIQUE NOT NULL,
  role VARCHAR(50) NOT NULL,
  pod_name VARCHAR(100),
  hostname VARCHAR(100),
  started_at TIMESTAMPTZ DEFAULT NOW(),
  last_heartbeat_at TIMESTAMPTZ DEFAULT NOW(),
  tasks_completed INTEGER DEFAULT 0,
  tasks_failed INTEGER DEFAULT 0,
  status VARCHAR(20) DEFAULT 'active',

  CONSTRAINT valid_worker_status CHECK (status IN ('active', 'idle', 'offline'))
);

CREATE INDEX IF NOT EXISTS idx_worker_registry_role
  ON worker_registry(role, status);

CREATE INDEX IF NOT EXISTS idx_worker_registry_heartbeat
  ON worker_registry(last_heartbeat_at)
  WHERE status = 'active';

-- Task completion tracking (summarized history)
CREATE TABLE IF NOT EXISTS task_completion_log (
  id SERIAL PRIMARY KEY,
  role VARCHAR(50) NOT NULL,
  date DATE NOT NULL DEFAULT CURRENT_DATE,
  hour INTEGER NOT NULL DEFAULT EXTRACT(HOUR FROM NOW()),

  tasks_created INTEGER DEFAULT 0,
  tasks_completed INTEGER DEFAULT 0,
  tasks_failed INTEGER DEFAULT 0,

  avg_duration_sec NUMERIC(10,2),
  min_duration_sec NUMERIC(10,2),
  max_duration_sec NUMERIC(10,2),

  updated_at TIMESTAMPTZ DEFAULT NOW(),

  UNIQUE(role, date, hour)
);

