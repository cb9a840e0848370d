-- An outbox row exists for a viewer's state row, never alone. Before this, an operator who deleted
-- a viewer's visibility_state row (to reset it) left the outbox row behind: every publication of
-- it came back 'stale' (no state to fence against) without clearing it, so it was claimed again
-- after every lease, forever, and visibility_lag() counted it as pending.
DELETE FROM buzz.visibility_outbox o
 WHERE NOT EXISTS (SELECT 1 FROM buzz.visibility_state s WHERE s.viewer = o.viewer);

ALTER TABLE buzz.visibility_outbox
  ADD CONSTRAINT visibility_outbox_viewer_fkey FOREIGN KEY (viewer)
      REFERENCES buzz.visibility_state (viewer) ON DELETE CASCADE;
