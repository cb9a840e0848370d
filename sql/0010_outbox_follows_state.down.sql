ALTER TABLE buzz.visibility_outbox DROP CONSTRAINT IF EXISTS visibility_outbox_viewer_fkey;
