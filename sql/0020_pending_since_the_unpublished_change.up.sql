-- How long a viewer has been pending counts from its oldest unpublished change. An outbox row's
-- enqueued_at was set when the row was made and kept when a publication of an older generation
-- left the row behind for a newer one: a viewer whose DMs kept changing never lost its row, and
-- visibility_lag() reported its lag growing without bound though every change converged. When a
-- publication leaves newer work behind, the row now counts from the viewer's latest change
-- (visibility_state.changed_at): the first unpublished change is no older than the publisher's
-- source read and no newer than that, so the figure errs by less than one publication.

CREATE FUNCTION buzz.outbox_pending_since_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE buzz.visibility_outbox o SET enqueued_at = NEW.changed_at
   WHERE o.viewer = NEW.viewer AND o.enqueued_at < NEW.changed_at;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.outbox_pending_since_change() IS
  'Trigger: a publication left a newer generation pending; its outbox row counts from the viewer''s latest change, not from when the row was first made.';

-- Row lock order as every writer: the state row (held by the publication), then the outbox row.
CREATE TRIGGER visibility_state_left_pending AFTER UPDATE OF published_generation ON buzz.visibility_state
  FOR EACH ROW WHEN (NEW.published_generation > OLD.published_generation
                     AND NEW.target_generation > NEW.published_generation)
  EXECUTE FUNCTION buzz.outbox_pending_since_change();
