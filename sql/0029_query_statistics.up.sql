-- 0029: planner statistics that keep up with bulk loads.
--
-- A table that grew from empty has no statistics until autovacuum analyzes it; until then
-- `{"kinds":[1],"limit":100}` ran as a bitmap scan plus a sort of every row (35 ms on 20,000
-- events) instead of a walk of events_kind_idx (0.9 ms). Autovacuum analyzes at 10 % of the rows
-- by default, on its own schedule (a minute per round). The relay calls buzz.refresh_statistics
-- every few seconds (internal/store/statistics.go); it analyzes a hot table whose rows changed by
-- more than a tenth since its last analyze, and costs one catalog read when none did.

ALTER TABLE buzz.events SET (autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 1000);
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
  IF NOT pg_try_advisory_xact_lock(hashtextextended('buzz.refresh_statistics', 0)) THEN
    RETURN done;
  END IF;
  FOR rel IN
    SELECT s.relid::regclass
    FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
    WHERE s.schemaname = 'buzz' AND s.relname IN ('events', 'members', 'channels', 'deleted_ids')
      AND s.n_mod_since_analyze >= 500
      AND s.n_mod_since_analyze > 0.1 * greatest(c.reltuples, 0)
  LOOP
    EXECUTE format('ANALYZE %s', rel);
    done := done || rel::text;
  END LOOP;
  RETURN done;
END $$;

REVOKE ALL ON FUNCTION buzz.refresh_statistics() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION buzz.refresh_statistics() TO buzz_relay, buzz_operator;
