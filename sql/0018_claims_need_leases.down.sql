ALTER TABLE buzz.visibility_outbox DROP CONSTRAINT IF EXISTS claimed_outbox_row_needs_lease;
ALTER TABLE buzz.reminders DROP CONSTRAINT IF EXISTS claimed_reminder_needs_lease;
