-- 0026: two hand-written writes could leave a viewer's snapshot wrong for good (found in review).
--
-- 1. TRUNCATE fires no row triggers. `TRUNCATE buzz.members` (or `TRUNCATE buzz.channels
--    CASCADE`, which truncates the members with it) emptied every viewer's hidden set without a
--    generation bump: nothing was pending, no sweep found work, and each viewer's published
--    snapshot kept its hidden DMs. A BEFORE TRUNCATE trigger on buzz.members now bumps every
--    viewer who had a DM hidden, as the row triggers would one row at a time. BEFORE, because the
--    rows are still there to read; the statement already holds ACCESS EXCLUSIVE on the table.
--
-- 2. A reset (DELETE of a viewer's buzz.visibility_state row, or TRUNCATE ... CASCADE) took the
--    outbox row with it. When a change was still unpublished, that change was lost: nothing was
--    pending and the published snapshot kept the state from before it until the viewer's next
--    change. A reset of a pending viewer now leaves it pending: its new row starts above the
--    retired generations (0011: published R, target R + 1), so every read from before the reset
--    is still 'stale' at the fence, and the publisher publishes the viewer's current state. A
--    viewer with nothing pending is reset as before (no row, nothing to do).
--
-- Locks: the members trigger bumps viewers sorted by pubkey (lock order 3, viewer state by
-- viewer) after the statement's table lock. A DELETE re-creates the row in its own AFTER DELETE
-- trigger, which fires after the outbox row's ON DELETE CASCADE (triggers fire in name order and
-- the foreign key's "RI_ConstraintTrigger_a_..." sorts first), so the new outbox row stays. A
-- change of that viewer racing the uncommitted reset now waits for the re-created row and lands
-- above it; one racing the reset of a viewer with nothing pending is refused with 40001 as before.
-- Not covered: one TRUNCATE naming both buzz.members and buzz.visibility_state; truncate them in
-- two statements.

CREATE FUNCTION buzz.members_hidden_truncated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM buzz.bump_visibility(v.pubkey)
     FROM (SELECT DISTINCT pubkey FROM buzz.members WHERE hidden_at IS NOT NULL ORDER BY pubkey) v;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_hidden_truncated() IS
  'Trigger (BEFORE TRUNCATE on members, also when a TRUNCATE of channels cascades to it): bumps the visibility generation of every viewer who had a DM hidden, as the row triggers would one row at a time.';
CREATE TRIGGER members_hidden_truncate BEFORE TRUNCATE ON buzz.members
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_hidden_truncated();

CREATE OR REPLACE FUNCTION buzz.visibility_state_retire() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM buzz.retire_generation(OLD.viewer, greatest(OLD.target_generation, OLD.published_generation));
  IF OLD.target_generation > OLD.published_generation THEN
    PERFORM buzz.bump_visibility(OLD.viewer);
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_retire() IS
  'Trigger (AFTER DELETE on visibility_state, per row): records the deleted row''s highest generation in visibility_retired, keeping the maximum; a row with an unpublished change is made again, pending above it, so the reset does not lose that change (0026).';

-- Viewers a TRUNCATE of visibility_state found pending, between its BEFORE and AFTER triggers.
CREATE TABLE buzz.visibility_reset_pending (
  viewer text PRIMARY KEY
);
COMMENT ON TABLE buzz.visibility_reset_pending IS
  'Viewers with an unpublished change when buzz.visibility_state was truncated; filled by its BEFORE TRUNCATE trigger and emptied by its AFTER TRUNCATE trigger in the same statement (0026). Empty otherwise.';

CREATE OR REPLACE FUNCTION buzz.visibility_state_retire_all() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- TRUNCATE fires no row triggers; it holds ACCESS EXCLUSIVE on the table already, so this reads
  -- every row that is about to go.
  PERFORM buzz.retire_generation(s.viewer, greatest(s.target_generation, s.published_generation))
     FROM buzz.visibility_state s;
  INSERT INTO buzz.visibility_reset_pending (viewer)
  SELECT viewer FROM buzz.visibility_state WHERE target_generation > published_generation
  ON CONFLICT DO NOTHING;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_retire_all() IS
  'Trigger (BEFORE TRUNCATE on visibility_state): records every row''s highest generation in visibility_retired, as the delete trigger would one row at a time, and the viewers with an unpublished change in visibility_reset_pending.';

CREATE FUNCTION buzz.visibility_state_reset_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM buzz.bump_visibility(p.viewer)
     FROM (SELECT viewer FROM buzz.visibility_reset_pending ORDER BY viewer) p;
  DELETE FROM buzz.visibility_reset_pending;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_reset_pending() IS
  'Trigger (AFTER TRUNCATE on visibility_state): makes each viewer that had an unpublished change pending again, above its retired generation, so the reset does not lose that change (0026).';
CREATE TRIGGER visibility_state_reset_pending AFTER TRUNCATE ON buzz.visibility_state
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_state_reset_pending();

GRANT SELECT, INSERT, UPDATE, DELETE ON buzz.visibility_reset_pending TO buzz_relay, buzz_operator;
