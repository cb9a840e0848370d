-- Upkeep: background purges that keep the database the size of what it serves.
--
-- One session at a time purges: the one holding the session advisory lock
-- buzz.upkeep_lock_key() (buzz.upkeep_try_lock()). The lock dies with its connection, so a
-- crashed purger never blocks the next one. Every purge function refuses to run in a session
-- that does not hold it.
--
-- Rules (the label of metrics and of buzz.upkeep_status()):
--   'expired'           events past their NIP-40 expiration by more than upkeep_grace_seconds;
--   'reminders'         reminder rows confirmed or cancelled more than upkeep_reminder_keep_seconds
--                       ago (never armed or claimed ones);
--   'retention:<name>'  an operator's buzz.retention row.
-- Each call of buzz.upkeep_purge removes one batch in its own short transaction.
--
-- Never purged, whatever a rule says (buzz.upkeep_keeps):
--   - kind 5 deletion requests; the tombstones in buzz.deleted_ids and buzz.deleted_addresses are
--     never touched at all, so NIP-09 keeps holding (a deleted id stays refused);
--   - DM control events (41010, 41011, 41012); buzz.channels, buzz.members and
--     buzz.visibility_state rows are never touched;
--   - the current 30622 head of a viewer (the one visibility_state names, and the newest per
--     viewer across relay keys);
--   - a 30300 version whose reminder is armed or claimed (delivery reads the event).
-- Retention rules also skip kind 30300: purging a delivered version would let it be stored and
-- armed again, and its due signal would go out twice (I6).
--
-- Deleting does not wake subscribers: the publication buzz_events stays publish = 'insert', so a
-- DELETE never reaches the fan-out stream (and so never reaches its de-duplication either).

INSERT INTO buzz.config (key, value) VALUES
  ('upkeep_grace_seconds', '300'),            -- expired events are kept this long past expiration
  ('upkeep_reminder_keep_seconds', '604800')  -- confirmed/cancelled reminder rows kept 7 days
ON CONFLICT (key) DO NOTHING;

-- Operator retention rules. Kinds are a list (kinds) or a range (kind_min..kind_max); events
-- whose created_at is older than max_age go, except each author's keep_newest newest events of
-- the rule's kinds when keep_newest is set.
CREATE TABLE buzz.retention (
  name        text    PRIMARY KEY CHECK (name ~ '^[a-z0-9_.-]{1,64}$'),
  kinds       integer[] CHECK (kinds IS NULL OR (cardinality(kinds) > 0 AND array_position(kinds, NULL) IS NULL)),
  kind_min    integer CHECK (kind_min BETWEEN 0 AND 65535),
  kind_max    integer CHECK (kind_max BETWEEN 0 AND 65535),
  max_age     interval NOT NULL CHECK (max_age >= interval '0'),
  keep_newest integer CHECK (keep_newest IS NULL OR keep_newest >= 1),
  enabled     boolean NOT NULL DEFAULT true,
  note        text,
  CHECK ((kinds IS NULL) = (kind_min IS NOT NULL AND kind_max IS NOT NULL)),
  CHECK ((kind_min IS NULL) = (kind_max IS NULL)),
  CHECK (kind_min IS NULL OR kind_min <= kind_max)
);
COMMENT ON TABLE buzz.retention IS
  'Operator retention rules, applied by the upkeep purge (rule retention:<name>): events of the kinds '
  '(list, or kind_min..kind_max) older than max_age by created_at are removed, except each author''s '
  'keep_newest newest of those kinds. Deletion requests, DM control events, current 30622 heads and '
  'reminder versions (30300) are never removed.';

-- What each rule did: written by the purge (removed_total) and at the end of a pass.
CREATE TABLE buzz.upkeep_log (
  rule          text PRIMARY KEY,
  last_run      timestamptz,            -- end of the last complete pass
  last_removed  bigint NOT NULL DEFAULT 0, -- rows that pass removed
  last_batch_at timestamptz,
  removed_total bigint NOT NULL DEFAULT 0
);
COMMENT ON TABLE buzz.upkeep_log IS 'Per upkeep rule: the last complete pass and rows removed in total.';

-- Settled reminder rows by the time they settled: the reminders purge reads them oldest first.
CREATE INDEX reminders_settled_idx ON buzz.reminders ((coalesce(confirmed_at, cancelled_at)))
  WHERE state IN ('confirmed', 'cancelled');

CREATE FUNCTION buzz.upkeep_lock_key() RETURNS bigint
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$ SELECT hashtextextended('buzz:upkeep'::text, 0::bigint) $$;
COMMENT ON FUNCTION buzz.upkeep_lock_key() IS
  'Key of the session advisory lock whose holder is the one process doing upkeep.';

CREATE FUNCTION buzz.upkeep_holds_lock() RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
  -- A bigint key shows in pg_locks as classid (high 32 bits), objid (low 32 bits), objsubid 1.
  SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks l
                  WHERE l.locktype = 'advisory'::text AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
                    AND l.objsubid = 1::smallint
                    AND ((l.classid::oid::bigint << 32) | l.objid::oid::bigint) = buzz.upkeep_lock_key())
$$;
COMMENT ON FUNCTION buzz.upkeep_holds_lock() IS
  'True when this session holds the upkeep lock (buzz.upkeep_try_lock).';

CREATE FUNCTION buzz.upkeep_require_lock() RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF NOT buzz.upkeep_holds_lock() THEN
    PERFORM buzz.reject('BZ403'::text, 'restricted: only the session holding the upkeep lock purges (buzz.upkeep_try_lock())'::text);
  END IF;
END $$;
COMMENT ON FUNCTION buzz.upkeep_require_lock() IS
  'Refuses (BZ403, restricted:) in a session that does not hold the upkeep lock: what purges and their bookkeeping check first.';

CREATE FUNCTION buzz.upkeep_try_lock() RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- Session locks stack: take it once, so one unlock (or the connection's end) frees it.
  IF buzz.upkeep_holds_lock() THEN
    RETURN true;
  END IF;
  RETURN pg_catalog.pg_try_advisory_lock(buzz.upkeep_lock_key());
END $$;
COMMENT ON FUNCTION buzz.upkeep_try_lock() IS
  'Takes the session-level upkeep lock without waiting; true when this session holds it. '
  'It lasts until pg_advisory_unlock(buzz.upkeep_lock_key()) or the end of the connection.';

CREATE FUNCTION buzz.upkeep_setting(p_key text) RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  v text := (SELECT c.value FROM buzz.config c WHERE c.key = p_key);
BEGIN
  IF v IS NULL OR v !~ '^[0-9]{1,12}$' THEN
    PERFORM buzz.reject('BZ400'::text, ('invalid: buzz.config ' || p_key || ' must be a whole number of seconds')::text);
  END IF;
  RETURN v::bigint;
END $$;
COMMENT ON FUNCTION buzz.upkeep_setting(text) IS
  'An upkeep setting from buzz.config, in seconds (upkeep_grace_seconds, upkeep_reminder_keep_seconds).';

-- The kinds buzz.upkeep_keeps may keep. Scans test the kind first and call upkeep_keeps only for
-- these: a call per row costs more than the rest of the scan. IMMUTABLE, so a query folds it once.
CREATE FUNCTION buzz.upkeep_guarded_kinds() RETURNS integer[]
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$ SELECT ARRAY[5, 30300, 30622, 41010, 41011, 41012]::integer[] $$;
COMMENT ON FUNCTION buzz.upkeep_guarded_kinds() IS
  'Kinds of which buzz.upkeep_keeps keeps some or all events; an event of any other kind it never keeps.';

-- The guards every event purge applies, rule or not. STABLE: it reads other tables.
CREATE FUNCTION buzz.upkeep_keeps(p_id text, p_kind integer, p_d text, p_created bigint) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF p_kind IN (5::integer, 41010::integer, 41011::integer, 41012::integer) THEN
    RETURN true;
  END IF;
  IF p_kind = 30622::integer THEN
    RETURN EXISTS (SELECT 1 FROM buzz.visibility_state v WHERE v.viewer = p_d AND v.published_event = p_id)
        OR NOT EXISTS (SELECT 1 FROM buzz.events x
                        WHERE x.kind = 30622::integer AND x.d_tag = p_d AND x.id <> p_id
                          AND (x.created_at > p_created OR (x.created_at = p_created AND x.id < p_id)));
  END IF;
  IF p_kind = 30300::integer THEN
    RETURN EXISTS (SELECT 1 FROM buzz.reminders r WHERE r.id = p_id AND r.state IN ('armed'::text, 'claimed'::text));
  END IF;
  RETURN false;
END $$;
COMMENT ON FUNCTION buzz.upkeep_keeps(text, integer, text, bigint) IS
  'True for an event no upkeep purge may remove: a deletion request (kind 5), a DM control event, '
  'the current 30622 head of a viewer, a 30300 version whose reminder is armed or claimed.';

-- Expired events past the grace period, oldest expiration first.
CREATE FUNCTION buzz.upkeep_expired_candidates(p_limit bigint) RETURNS SETOF text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  cutoff bigint := buzz.now_unix() - buzz.upkeep_setting('upkeep_grace_seconds'::text);
BEGIN
  RETURN QUERY
  SELECT e.id FROM buzz.events e
   WHERE e.expires_at IS NOT NULL AND e.expires_at < cutoff
     AND NOT (e.kind = ANY (buzz.upkeep_guarded_kinds()) AND buzz.upkeep_keeps(e.id, e.kind, e.d_tag, e.created_at))
   ORDER BY e.expires_at
   LIMIT p_limit;
END $$;
COMMENT ON FUNCTION buzz.upkeep_expired_candidates(bigint) IS
  'Ids of events whose NIP-40 expiration passed more than upkeep_grace_seconds ago (at most p_limit; NULL: all).';

-- Settled reminder rows older than the keep setting. A cancelled version is armed again if it is
-- stored again, so its row may go. A confirmed one keeps its row so its signal is never
-- sent twice (I6): it goes only once its version can no longer be armed again by accept_event:
-- expired, tombstoned by id or by address, still stored (a duplicate), or superseded by a newer
-- stored version. The last two hold until every newer version is deleted by id and the author
-- publishes the old one again: that version would then fire a second time.
CREATE FUNCTION buzz.upkeep_reminder_candidates(p_limit bigint) RETURNS SETOF text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  cutoff timestamptz := now() - pg_catalog.make_interval(secs => buzz.upkeep_setting('upkeep_reminder_keep_seconds'::text)::double precision);
  now_s bigint := buzz.now_unix();
BEGIN
  RETURN QUERY
  SELECT r.id FROM buzz.reminders r
   WHERE r.state IN ('confirmed'::text, 'cancelled'::text)
     AND coalesce(r.confirmed_at, r.cancelled_at) < cutoff
     AND (r.state = 'cancelled'::text
          OR r.expires_at <= now_s
          OR EXISTS (SELECT 1 FROM buzz.deleted_ids d WHERE d.id = r.id AND d.pubkey = r.pubkey)
          OR EXISTS (SELECT 1 FROM buzz.deleted_addresses a
                      WHERE a.kind = 30300::integer AND a.pubkey = r.pubkey AND a.d_tag = r.d_tag
                        AND a.until_created_at >= r.created_at)
          OR EXISTS (SELECT 1 FROM buzz.events e
                      WHERE e.kind = 30300::integer AND e.pubkey = r.pubkey AND e.d_tag = r.d_tag
                        AND (e.id = r.id OR e.created_at > r.created_at
                             OR (e.created_at = r.created_at AND e.id < r.id))))
   ORDER BY coalesce(r.confirmed_at, r.cancelled_at)
   LIMIT p_limit;
END $$;
COMMENT ON FUNCTION buzz.upkeep_reminder_candidates(bigint) IS
  'Ids of reminder rows confirmed or cancelled more than upkeep_reminder_keep_seconds ago whose removal '
  'cannot make a delivered version fire again (at most p_limit; NULL: all). Never armed or claimed rows.';

-- What a retention rule scans: a list of kinds is also scanned as its min..max range, so the kind
-- index serves both forms; events created before cutoff are older than the rule's max_age.
CREATE FUNCTION buzz.upkeep_retention_scope(r buzz.retention, OUT lo integer, OUT hi integer, OUT cutoff bigint)
LANGUAGE sql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
  SELECT coalesce(r.kind_min, (SELECT min(k) FROM unnest(r.kinds) k)),
         coalesce(r.kind_max, (SELECT max(k) FROM unnest(r.kinds) k)),
         buzz.now_unix() - floor(extract(epoch FROM r.max_age))::bigint
$$;
COMMENT ON FUNCTION buzz.upkeep_retention_scope(buzz.retention) IS
  'The kind range (lo..hi) and the created_at cutoff of retention rule r, now.';

-- Events an operator's retention rule removes, oldest first.
CREATE FUNCTION buzz.upkeep_retention_candidates(p_name text, p_limit bigint) RETURNS SETOF text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  r buzz.retention;
  lo integer;
  hi integer;
  cutoff bigint;
BEGIN
  SELECT * INTO r FROM buzz.retention x WHERE x.name = p_name;
  IF NOT FOUND THEN
    RETURN;  -- removed since the pass listed it: nothing to do, not a failed pass
  END IF;
  SELECT x.lo, x.hi, x.cutoff INTO lo, hi, cutoff FROM buzz.upkeep_retention_scope(r) x;
  RETURN QUERY
  SELECT e.id FROM buzz.events e
   WHERE e.kind BETWEEN lo AND hi AND (r.kinds IS NULL OR e.kind = ANY (r.kinds))
     AND e.created_at < cutoff
     AND e.kind <> 30300::integer
     AND NOT (e.kind = ANY (buzz.upkeep_guarded_kinds()) AND buzz.upkeep_keeps(e.id, e.kind, e.d_tag, e.created_at))
     AND (r.keep_newest IS NULL
          OR (SELECT count(*) FROM (
                SELECT 1 FROM buzz.events x
                 WHERE x.pubkey = e.pubkey AND x.kind BETWEEN lo AND hi
                   AND (r.kinds IS NULL OR x.kind = ANY (r.kinds))
                   AND (x.created_at > e.created_at OR (x.created_at = e.created_at AND x.id > e.id))
                 LIMIT r.keep_newest) newer) >= r.keep_newest::bigint)
   ORDER BY e.created_at
   LIMIT p_limit;
END $$;
COMMENT ON FUNCTION buzz.upkeep_retention_candidates(text, bigint) IS
  'Ids of events retention rule p_name removes (at most p_limit; NULL: all; none if there is no such rule): its kinds, created_at older '
  'than max_age, not among their author''s keep_newest newest of those kinds, and not kept by buzz.upkeep_keeps.';

-- How many events a retention rule removes now. The same predicate as
-- buzz.upkeep_retention_candidates, with keep_newest as one window over the rule's kinds instead
-- of a look-up per row: a purge batch stops after a few hundred rows, a count does not.
CREATE FUNCTION buzz.upkeep_retention_waiting(p_name text) RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  r buzz.retention;
  lo integer;
  hi integer;
  cutoff bigint;
BEGIN
  SELECT * INTO r FROM buzz.retention x WHERE x.name = p_name;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;
  IF r.keep_newest IS NULL THEN
    RETURN (SELECT count(*) FROM buzz.upkeep_retention_candidates(p_name, NULL::bigint));
  END IF;
  SELECT x.lo, x.hi, x.cutoff INTO lo, hi, cutoff FROM buzz.upkeep_retention_scope(r) x;
  RETURN (SELECT count(*) FROM (
            SELECT e.id, e.kind, e.d_tag, e.created_at,
                   row_number() OVER (PARTITION BY e.pubkey ORDER BY e.created_at DESC, e.id DESC) AS rank
              FROM buzz.events e
             WHERE e.kind BETWEEN lo AND hi AND (r.kinds IS NULL OR e.kind = ANY (r.kinds))) s
           WHERE s.rank > r.keep_newest::bigint AND s.created_at < cutoff AND s.kind <> 30300::integer
             AND NOT (s.kind = ANY (buzz.upkeep_guarded_kinds()) AND buzz.upkeep_keeps(s.id, s.kind, s.d_tag, s.created_at)));
END $$;
COMMENT ON FUNCTION buzz.upkeep_retention_waiting(text) IS
  'How many events retention rule p_name would remove now (NULL when there is no such rule).';

CREATE FUNCTION buzz.upkeep_candidates(p_rule text, p_limit bigint) RETURNS SETOF text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF p_rule = 'expired'::text THEN
    RETURN QUERY SELECT * FROM buzz.upkeep_expired_candidates(p_limit);
  ELSIF p_rule = 'reminders'::text THEN
    RETURN QUERY SELECT * FROM buzz.upkeep_reminder_candidates(p_limit);
  ELSIF p_rule LIKE 'retention:%' THEN
    RETURN QUERY SELECT * FROM buzz.upkeep_retention_candidates(substr(p_rule, 11), p_limit);
  ELSE
    PERFORM buzz.reject('BZ400'::text, ('invalid: unknown upkeep rule ' || coalesce(p_rule, 'NULL'))::text);
  END IF;
END $$;
COMMENT ON FUNCTION buzz.upkeep_candidates(text, bigint) IS
  'Ids rule p_rule (expired, reminders, retention:<name>) would remove now, at most p_limit (NULL: all).';

-- One batch of one rule, in the caller's (short) transaction.
--
-- Locks: the purge never waits. It takes each candidate's 'event:'||id advisory lock with
-- pg_try_advisory_xact_lock and each row with FOR UPDATE SKIP LOCKED, skipping whatever is busy
-- (the next pass gets it). accept_event and apply_deletion take event:<id> locks, then address
-- locks, then rows, and a NIP-09 deletion by address locks rows it holds no event:<id> lock for:
-- a purger that waited for an event:<id> lock while holding a row could deadlock with it. One
-- that never waits cannot be part of a deadlock, and the hot path waits at most for one short
-- batch on a row both touch. The event:<id> lock makes the purge and an acceptance of the same id
-- take turns, as acceptance and deletion do. Reminder rows are not guarded by advisory locks
-- (their writers lock them in id order, sql/0004_reminders.up.sql): SKIP LOCKED alone.
CREATE FUNCTION buzz.upkeep_purge(p_rule text, p_batch integer) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  ids text[];
  n integer;
BEGIN
  PERFORM buzz.upkeep_require_lock();
  IF p_batch IS NULL OR p_batch < 1 THEN
    PERFORM buzz.reject('BZ400'::text, 'invalid: p_batch must be 1 or more'::text);
  END IF;
  ids := ARRAY(SELECT c FROM buzz.upkeep_candidates(p_rule, p_batch::bigint) c);
  IF p_rule = 'reminders'::text THEN
    -- Re-checked under the row lock: a row armed again meanwhile (its version stored again) is left alone.
    ids := ARRAY(SELECT r.id FROM buzz.reminders r
                  WHERE r.id = ANY (ids) AND r.state IN ('confirmed'::text, 'cancelled'::text)
                  ORDER BY r.id FOR UPDATE SKIP LOCKED);
    DELETE FROM buzz.reminders r WHERE r.id = ANY (ids) AND r.state IN ('confirmed'::text, 'cancelled'::text);
  ELSE
    ids := ARRAY(SELECT i FROM unnest(ids) i
                  WHERE pg_catalog.pg_try_advisory_xact_lock(hashtextextended('event:'::text || i, 0::bigint)));
    -- Under the locks, the guards again: a 30300 armed again or a newer head changes the answer.
    ids := ARRAY(SELECT e.id FROM buzz.events e
                  WHERE e.id = ANY (ids) AND NOT (e.kind = ANY (buzz.upkeep_guarded_kinds()) AND buzz.upkeep_keeps(e.id, e.kind, e.d_tag, e.created_at))
                  ORDER BY e.id FOR UPDATE SKIP LOCKED);
    DELETE FROM buzz.events e WHERE e.id = ANY (ids);
  END IF;
  GET DIAGNOSTICS n = ROW_COUNT;
  INSERT INTO buzz.upkeep_log AS l (rule, last_batch_at, removed_total)
  VALUES (p_rule, now(), n::bigint)
  ON CONFLICT (rule) DO UPDATE SET last_batch_at = now(), removed_total = l.removed_total + n::bigint;
  RETURN n;
END $$;
COMMENT ON FUNCTION buzz.upkeep_purge(text, integer) IS
  'Removes at most p_batch rows of rule p_rule (expired, reminders, retention:<name>) and returns how many. '
  'Only in the session holding the upkeep lock. Never waits for a lock: busy rows are left to the next pass.';

CREATE FUNCTION buzz.upkeep_finish(p_rule text, p_removed bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  PERFORM buzz.upkeep_require_lock();
  INSERT INTO buzz.upkeep_log AS l (rule, last_run, last_removed)
  VALUES (p_rule, now(), coalesce(p_removed, 0::bigint))
  ON CONFLICT (rule) DO UPDATE SET last_run = now(), last_removed = coalesce(p_removed, 0::bigint);
END $$;
COMMENT ON FUNCTION buzz.upkeep_finish(text, bigint) IS
  'Records the end of a complete pass of rule p_rule that removed p_removed rows.';

CREATE FUNCTION buzz.upkeep_status()
RETURNS TABLE (rule text, enabled boolean, last_run timestamptz, last_removed bigint, removed_total bigint, waiting bigint)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN QUERY
  WITH rules AS (
    SELECT 'expired'::text AS rule, true AS enabled, 1 AS ord
    UNION ALL SELECT 'reminders'::text, true, 2
    UNION ALL SELECT 'retention:'::text || x.name, x.enabled, 3 FROM buzz.retention x
    UNION ALL SELECT l.rule, false, 4 FROM buzz.upkeep_log l      -- rules since removed
     WHERE l.rule LIKE 'retention:%'
       AND NOT EXISTS (SELECT 1 FROM buzz.retention x WHERE 'retention:'::text || x.name = l.rule)
  )
  SELECT r.rule, r.enabled, l.last_run, coalesce(l.last_removed, 0::bigint), coalesce(l.removed_total, 0::bigint),
         CASE WHEN r.ord < 3 THEN (SELECT count(*) FROM buzz.upkeep_candidates(r.rule, NULL::bigint))
              WHEN r.ord = 3 THEN buzz.upkeep_retention_waiting(substr(r.rule, 11)) END
    FROM rules r LEFT JOIN buzz.upkeep_log l ON l.rule = r.rule
   ORDER BY r.ord, r.rule;
END $$;
COMMENT ON FUNCTION buzz.upkeep_status() IS
  'Per upkeep rule: whether it runs, the end of its last complete pass, rows that pass removed, rows removed '
  'in total, and rows waiting to be removed now (counted on call; NULL for a rule that no longer exists).';

-- Grants. The purge and its bookkeeping run as the owner (SECURITY DEFINER above): the relay's
-- role deletes nothing by hand. Retention rules are the operator's policy, edited from psql.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA buzz FROM PUBLIC;
GRANT EXECUTE ON FUNCTION buzz.upkeep_try_lock(), buzz.upkeep_purge(text, integer),
  buzz.upkeep_finish(text, bigint), buzz.upkeep_status() TO buzz_relay;
GRANT SELECT ON buzz.retention, buzz.upkeep_log TO buzz_relay;
GRANT EXECUTE ON FUNCTION buzz.upkeep_status() TO buzz_operator;
GRANT SELECT, INSERT, UPDATE, DELETE ON buzz.retention TO buzz_operator;

-- Planner statistics that keep up with bulk loads.
--
-- A table that grew from empty has no statistics until autovacuum analyzes it; until then
-- `{"kinds":[1],"limit":100}` ran as a bitmap scan plus a sort of every row (35 ms on 20,000
-- events) instead of a walk of events_kind_idx (0.9 ms). Autovacuum analyzes at 10 % of the rows
-- by default, on its own schedule (a minute per round). The relay calls buzz.refresh_statistics
-- every few seconds (internal/store/statistics.go); it analyzes a hot table whose rows changed by
-- more than half since its last analyze, and costs one catalog read when none did. Half, not a
-- tenth: a plan needs statistics of the table's shape, which a table two thirds as large has (the
-- planner scales row counts to the table's current size), and each ANALYZE of a growing table
-- costs 25-200 ms of CPU: a tenth analyzed a 60,000-event load 12 times (1.2 s of CPU, 20 µs per
-- event, as much as a tenth of accepting it), half 4 times (0.24 s; docs/benchmarks.md).

ALTER TABLE buzz.events SET (autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 1000);
-- No filter or join reads these columns' statistics (ids are unique by their index; tag filters
-- read buzz.event_tags), and ANALYZE spent most of its time on them: 220-260 ms for 20,000
-- events, 40 ms without.
ALTER TABLE buzz.events
  ALTER COLUMN id SET STATISTICS 0, ALTER COLUMN content SET STATISTICS 0, ALTER COLUMN sig SET STATISTICS 0,
  ALTER COLUMN tags SET STATISTICS 0, ALTER COLUMN received_at SET STATISTICS 0, ALTER COLUMN tagvals SET STATISTICS 0;
ALTER TABLE buzz.event_tags SET (autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 1000);
ALTER TABLE buzz.members SET (autovacuum_analyze_scale_factor = 0.05, autovacuum_analyze_threshold = 500);

-- SECURITY DEFINER: ANALYZE needs the tables' owner (the role that migrates); the relay's role may
-- only call this. Returns the tables it analyzed.
CREATE FUNCTION buzz.refresh_statistics() RETURNS text[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, buzz, pg_temp AS $$
DECLARE
  rel regclass;
  done text[] := '{}';
BEGIN
  -- One process at a time: the others skip (several relays call this).
  IF NOT pg_try_advisory_xact_lock(pg_catalog.hashtextextended('buzz.refresh_statistics', 0::bigint)) THEN
    RETURN done;
  END IF;
  FOR rel IN
    SELECT s.relid::regclass
    FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
    WHERE s.schemaname = 'buzz' AND s.relname IN ('events', 'event_tags', 'members', 'channels', 'deleted_ids')
      AND s.n_mod_since_analyze >= 500
      AND s.n_mod_since_analyze > 0.5 * greatest(c.reltuples, 0)
  LOOP
    EXECUTE format('ANALYZE %s', rel);
    done := done || rel::text;
  END LOOP;
  RETURN done;
END $$;

REVOKE ALL ON FUNCTION buzz.refresh_statistics() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION buzz.refresh_statistics() TO buzz_relay, buzz_operator;
