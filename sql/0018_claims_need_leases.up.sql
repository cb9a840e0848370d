-- Every claim carries a lease. A claim is recovered by others only once its lease is behind the
-- clock (lease_until < now()), which a NULL lease never is: claim_due_reminders(n, NULL) or
-- claim_visibility_work(id, n, NULL) from psql left rows claimed for good, out of every later
-- claim and sweep and counted as stuck by nobody. The constraints refuse such a claim (23514)
-- and also cover hand-written UPDATEs. Rows already in that state are first made recoverable.

UPDATE buzz.reminders SET lease_until = now() WHERE state = 'claimed' AND lease_until IS NULL;
ALTER TABLE buzz.reminders ADD CONSTRAINT claimed_reminder_needs_lease
  CHECK (state <> 'claimed' OR lease_until IS NOT NULL);

UPDATE buzz.visibility_outbox SET lease_until = now() WHERE claim_id IS NOT NULL AND lease_until IS NULL;
ALTER TABLE buzz.visibility_outbox ADD CONSTRAINT claimed_outbox_row_needs_lease
  CHECK (claim_id IS NULL OR lease_until IS NOT NULL);
