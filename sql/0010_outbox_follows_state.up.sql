-- 0010: an outbox row follows its viewer's state row, and a viewer's published generation never
-- passes its target.
--
-- Before this, an operator who deleted a viewer's visibility_state row (to reset it) left the
-- outbox row behind: every publication of it came back 'stale' (no state to fence against)
-- without clearing it, so it was claimed again after every lease, forever. And a publisher that
-- had read the viewer's source before the delete could still publish that old generation g over
-- the restarted state (published 0 < g passes the fence), marking the next g - 1 changes as
-- already published. The CHECK turns that publication into an error (SQLSTATE 23514, this
-- constraint's name), which the listener takes as 'retry': it re-reads and finds the new
-- generation. A constraint rather than a copy of publish_visibility_snapshot with one more
-- condition: it holds for every writer, psql included.

-- Both tables at once, in the order every writer takes them (state, then outbox): nothing can
-- slip an orphan in between the cleanup and the constraints, and no writer deadlocks with us.
LOCK TABLE buzz.visibility_state, buzz.visibility_outbox IN SHARE ROW EXCLUSIVE MODE;

DELETE FROM buzz.visibility_outbox o
 WHERE NOT EXISTS (SELECT 1 FROM buzz.visibility_state s WHERE s.viewer = o.viewer);

-- A viewer that the race above already left with published > target is made pending again one
-- generation above, so its snapshot is rebuilt from the real hidden set.
WITH bad AS (
  UPDATE buzz.visibility_state
     SET target_generation = published_generation + 1, changed_at = now()
   WHERE published_generation > target_generation
  RETURNING viewer, target_generation)
INSERT INTO buzz.visibility_outbox AS o (viewer, generation)
SELECT viewer, target_generation FROM bad
ON CONFLICT (viewer) DO UPDATE
  SET generation = EXCLUDED.generation, available_at = now(), attempts = 0, last_error = NULL,
      claim_id = NULL, lease_until = NULL;

ALTER TABLE buzz.visibility_state
  ADD CONSTRAINT visibility_state_published_le_target CHECK (published_generation <= target_generation);

ALTER TABLE buzz.visibility_outbox
  ADD CONSTRAINT visibility_outbox_viewer_fkey FOREIGN KEY (viewer)
      REFERENCES buzz.visibility_state (viewer) ON DELETE CASCADE;
