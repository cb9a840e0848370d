-- 0026: two hand-written writes could leave a viewer's snapshot wrong for good (found in review).
--
-- 1. TRUNCATE fires no row triggers. `TRUNCATE buzz.members` (or `TRUNCATE buzz.channels
--    CASCADE`, which truncates the members with it) emptied every viewer's hidden set without a
--    generation bump: nothing was pending, no sweep found work, and each viewer's published
--    snapshot kept its hidden DMs. Now every viewer who had a DM hidden is bumped, as the row
--    triggers would one row at a time: a BEFORE TRUNCATE trigger records them (the rows are still
--    there to read, under the statement's ACCESS EXCLUSIVE lock), an AFTER TRUNCATE trigger bumps
--    them once every table of the statement is truncated.
--
-- 2. A reset (DELETE of a viewer's buzz.visibility_state row, or TRUNCATE ... CASCADE) took the
--    outbox row with it. When a change was still unpublished, that change was lost: nothing was
--    pending and the published snapshot kept the state from before it until the viewer's next
--    change. A reset of a pending viewer now leaves it pending: its new row starts above the
--    retired generations (0011: published R, target R + 1), so every read from before the reset
--    is still 'stale' at the fence, and the publisher publishes the viewer's current state. A
--    viewer with nothing pending is reset as before (no row, nothing to do).
--
-- Locks: the AFTER TRUNCATE triggers bump viewers sorted by pubkey (lock order 3, viewer state by
-- viewer) after the statement's table locks. A DELETE re-creates the row in its own AFTER DELETE
-- trigger, which fires after the outbox row's ON DELETE CASCADE (triggers fire in name order and
-- the foreign key's "RI_ConstraintTrigger_a_..." sorts first), so the new outbox row stays. A
-- change of that viewer racing the uncommitted reset now waits for the re-created row and lands
-- above it; one racing the reset of a viewer with nothing pending is refused with 40001 as before.
-- Both kinds of TRUNCATE record into one table, buzz.visibility_reset_pending, and the first AFTER
-- trigger of the statement bumps what it holds: one TRUNCATE may name both tables, in any order
-- (with channels CASCADE too).


-- Viewers a TRUNCATE statement must bump once its tables are gone: found by the BEFORE TRUNCATE
-- triggers of members (had a DM hidden) and visibility_state (had a change pending), bumped and
-- removed by the first AFTER TRUNCATE trigger. AFTER triggers run once every table the statement
-- names, or cascades to, is truncated, so the order of the tables does not matter.
CREATE TABLE buzz.visibility_reset_pending (
  viewer text PRIMARY KEY
);
COMMENT ON TABLE buzz.visibility_reset_pending IS
  'Viewers to bump once a TRUNCATE of buzz.members or buzz.visibility_state is done: filled by their BEFORE TRUNCATE triggers, emptied by the first AFTER TRUNCATE trigger of the same statement (0026). Empty otherwise.';

CREATE FUNCTION buzz.visibility_reset_bump() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM buzz.bump_visibility(p.viewer)
     FROM (SELECT viewer FROM buzz.visibility_reset_pending ORDER BY viewer) p;
  DELETE FROM buzz.visibility_reset_pending;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_reset_bump() IS
  'Trigger (AFTER TRUNCATE on members and on visibility_state): bumps every viewer the BEFORE TRUNCATE triggers recorded in visibility_reset_pending (a hidden set emptied, or an unpublished change reset), above any retired generation, and empties it (0026).';

CREATE FUNCTION buzz.members_hidden_truncated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO buzz.visibility_reset_pending (viewer)
  SELECT DISTINCT pubkey FROM buzz.members WHERE hidden_at IS NOT NULL
  ON CONFLICT DO NOTHING;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_hidden_truncated() IS
  'Trigger (BEFORE TRUNCATE on members, also when a TRUNCATE of channels cascades to it): records every viewer who had a DM hidden in visibility_reset_pending; visibility_reset_bump bumps them once the statement''s tables are truncated, as the row triggers would have one row at a time.';
CREATE TRIGGER members_hidden_truncate BEFORE TRUNCATE ON buzz.members
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_hidden_truncated();
CREATE TRIGGER members_hidden_truncated AFTER TRUNCATE ON buzz.members
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_reset_bump();

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

CREATE TRIGGER visibility_state_reset_pending AFTER TRUNCATE ON buzz.visibility_state
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_reset_bump();

GRANT SELECT, INSERT, UPDATE, DELETE ON buzz.visibility_reset_pending TO buzz_relay, buzz_operator;
