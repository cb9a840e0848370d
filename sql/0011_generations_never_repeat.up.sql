-- 0011: a viewer's generations never repeat, not even across a deleted state row.
--
-- The fence (publish_visibility_snapshot: published_generation < g) and the CHECK of 0010
-- (published <= target) compare generation numbers, so they hold only while a number names one
-- state of the viewer. An operator who resets a viewer deletes its visibility_state row, and before
-- this the next bump started the row again at generation 1. A publisher that had read generation 3
-- (X hidden) before the reset and resumed after three changes of the restarted row (target 3,
-- published 0, nothing hidden) passed both: it published X hidden as generation 3, cleared the
-- outbox, and the viewer stayed wrong until their next change.
--
-- Now a deleted row leaves its highest generation in buzz.visibility_retired, and a row inserted
-- for that viewer later starts above it: both generations lifted by the retired one, so the new
-- row is pending exactly as the insert meant (bump_visibility's row: published R, target R + 1),
-- and every read from before the reset (generation <= R) is 'stale' at the fence. The retired row
-- is kept: it is one row per viewer ever reset, and without it the numbers could repeat again.
--
-- Costs: every bump runs the BEFORE INSERT trigger (the upsert's conflict check comes after it),
-- which is one index probe of buzz.visibility_retired, normally empty; the two other row triggers
-- fire only when a state row is really inserted (a viewer's first change) or deleted (a reset).
-- Locks: a delete takes the retired row after the state row (lock order 3, then this table by
-- viewer); the insert path reads buzz.visibility_retired without locking it. The documented order
-- (channel, members by pubkey, viewer state by viewer, outbox by viewer) is unchanged.
--
-- Not covered (not a reset; do not do these): an UPDATE that lowers a viewer's generations or
-- changes the viewer column, and deleting rows of buzz.visibility_retired while a publisher that
-- read before the reset may still be running. Under REPEATABLE READ or SERIALIZABLE the race check
-- below reads the transaction's snapshot and can miss a reset committed after it; buzzpg's own
-- writers run at READ COMMITTED.

CREATE TABLE buzz.visibility_retired (
  viewer     text   PRIMARY KEY,
  generation bigint NOT NULL
);
COMMENT ON TABLE buzz.visibility_retired IS
  'The highest generation of every viewer whose visibility_state row was deleted (or truncated): a row inserted for that viewer later starts above it, so generation numbers never repeat (0011). Kept for good; do not delete from it.';

CREATE FUNCTION buzz.retire_generation(p_viewer text, p_generation bigint) RETURNS void
LANGUAGE sql AS $$
  INSERT INTO buzz.visibility_retired AS r (viewer, generation) VALUES (p_viewer, p_generation)
  ON CONFLICT (viewer) DO UPDATE SET generation = EXCLUDED.generation
   WHERE EXCLUDED.generation > r.generation
$$;
COMMENT ON FUNCTION buzz.retire_generation(text, bigint) IS
  'Records that p_viewer''s generations up to p_generation were used (keeping the maximum): a visibility_state row inserted for that viewer later starts above it.';

CREATE FUNCTION buzz.visibility_state_retire() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM buzz.retire_generation(OLD.viewer, greatest(OLD.target_generation, OLD.published_generation));
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_retire() IS
  'Trigger (AFTER DELETE on visibility_state, per row): records the deleted row''s highest generation in visibility_retired, keeping the maximum.';
CREATE TRIGGER visibility_state_retire AFTER DELETE ON buzz.visibility_state
  FOR EACH ROW EXECUTE FUNCTION buzz.visibility_state_retire();

CREATE FUNCTION buzz.visibility_state_retire_all() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- TRUNCATE fires no row triggers; it holds ACCESS EXCLUSIVE on the table already, so this reads
  -- every row that is about to go.
  PERFORM buzz.retire_generation(s.viewer, greatest(s.target_generation, s.published_generation))
     FROM buzz.visibility_state s;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_retire_all() IS
  'Trigger (BEFORE TRUNCATE on visibility_state): records every row''s highest generation in visibility_retired, as the delete trigger would one row at a time.';
CREATE TRIGGER visibility_state_retire_all BEFORE TRUNCATE ON buzz.visibility_state
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_state_retire_all();

CREATE FUNCTION buzz.visibility_state_lift() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE retired bigint;
BEGIN
  SELECT r.generation INTO retired FROM buzz.visibility_retired r WHERE r.viewer = NEW.viewer;
  IF retired IS NOT NULL THEN
    NEW.published_generation := NEW.published_generation + retired;
    NEW.target_generation := NEW.target_generation + retired;
  END IF;
  RETURN NEW;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_lift() IS
  'Trigger (BEFORE INSERT on visibility_state, per row): a viewer with a retired generation R starts again above it: published and target are both lifted by R (published <= target and pending-ness kept). Also runs for an upsert that ends in its UPDATE branch, where the lifted values are unused.';
CREATE TRIGGER visibility_state_lift BEFORE INSERT ON buzz.visibility_state
  FOR EACH ROW EXECUTE FUNCTION buzz.visibility_state_lift();

CREATE FUNCTION buzz.visibility_state_check_lift() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- The race the BEFORE trigger cannot see: a reset still uncommitted when it read
  -- visibility_retired, whose deleted row this insert then waited for (unique check or upsert
  -- lock) and replaced. This statement's snapshot is newer than that wait, so it sees the reset.
  IF EXISTS (SELECT 1 FROM buzz.visibility_retired r
              WHERE r.viewer = NEW.viewer AND r.generation > NEW.published_generation) THEN
    RAISE EXCEPTION USING ERRCODE = 'serialization_failure',
      MESSAGE = 'visibility state of ' || NEW.viewer || ' was reset concurrently; retry',
      HINT = 'buzzpg retries SQLSTATE 40001; from psql, run the statement again.';
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_check_lift() IS
  'Trigger (AFTER INSERT on visibility_state, per row; fires only when a row was really inserted): refuses with SQLSTATE 40001 a new row whose published generation is below a retired generation of its viewer (a reset committed while the insert was under way); the retry is lifted.';
CREATE TRIGGER visibility_state_check_lift AFTER INSERT ON buzz.visibility_state
  FOR EACH ROW EXECUTE FUNCTION buzz.visibility_state_check_lift();
