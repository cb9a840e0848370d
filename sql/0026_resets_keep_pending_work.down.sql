-- Back to 0025: TRUNCATE of buzz.members bumps no generation, and a reset drops pending work.

DROP TRIGGER visibility_state_reset_pending ON buzz.visibility_state;
DROP TRIGGER members_hidden_truncated ON buzz.members;
DROP FUNCTION buzz.visibility_reset_bump();
DROP TRIGGER members_hidden_truncate ON buzz.members;
DROP FUNCTION buzz.members_hidden_truncated();

CREATE OR REPLACE FUNCTION buzz.visibility_state_retire() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM buzz.retire_generation(OLD.viewer, greatest(OLD.target_generation, OLD.published_generation));
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_retire() IS
  'Trigger (AFTER DELETE on visibility_state, per row): records the deleted row''s highest generation in visibility_retired, keeping the maximum.';

CREATE OR REPLACE FUNCTION buzz.visibility_state_retire_all() RETURNS trigger
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

DROP TABLE buzz.visibility_reset_pending;
