ALTER TABLE buzz.visibility_outbox DROP CONSTRAINT IF EXISTS visibility_outbox_viewer_fkey;
ALTER TABLE buzz.visibility_state DROP CONSTRAINT IF EXISTS visibility_state_published_le_target;
