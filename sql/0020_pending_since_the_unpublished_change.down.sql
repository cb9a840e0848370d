DROP TRIGGER IF EXISTS visibility_state_left_pending ON buzz.visibility_state;
DROP FUNCTION IF EXISTS buzz.outbox_pending_since_change();
