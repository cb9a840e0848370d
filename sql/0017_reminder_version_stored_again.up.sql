-- A reminder version can be stored a second time: V1 replaced by V2, V2 deleted by id (which
-- leaves no tombstone for V1's address), then V1 published again is once more the newest version
-- and accept_event stores it. arm_reminder's plain INSERT then hit V1's old row (23505), the
-- whole acceptance failed, and the client was told to retry forever.
--
-- V1's old row is cancelled (replaced before it was due) or confirmed (its due signal went out).
-- A cancelled version never signalled: it is armed again. A confirmed one keeps its row, so its
-- signal is never sent twice (I6: once per version).

CREATE OR REPLACE FUNCTION buzz.arm_reminder(p_id text, p_pubkey text, p_d text, p_created_at bigint,
                                             p_not_before bigint, p_expires bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE buzz.reminders r SET state = 'cancelled', cancelled_at = now(), lease_until = NULL
   WHERE r.pubkey = p_pubkey AND r.d_tag = p_d AND r.state IN ('armed', 'claimed');
  IF p_not_before IS NOT NULL THEN
    INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before, expires_at)
    VALUES (p_id, p_pubkey, p_d, p_created_at, p_not_before, p_expires)
    ON CONFLICT (id) DO UPDATE SET state = 'armed', cancelled_at = NULL, claimed_at = NULL, lease_until = NULL
     WHERE buzz.reminders.state = 'cancelled';
    -- NOTIFY serialises committing transactions, so it stays off the common path (a reminder due
    -- after another one a scheduler already sleeps until). Payload: when this one is due.
    IF NOT EXISTS (SELECT 1 FROM buzz.reminders r
                    WHERE r.state = 'armed' AND r.not_before <= p_not_before AND r.id <> p_id
                      AND r.not_before > buzz.now_unix() + 1
                      AND (r.expires_at IS NULL OR r.expires_at > buzz.now_unix())) THEN
      PERFORM pg_notify('buzz_reminders', p_not_before::text);
    END IF;
  END IF;
END $$;
COMMENT ON FUNCTION buzz.arm_reminder(text, text, text, bigint, bigint, bigint) IS
  'Arms the reminder row of a new 30300 version and cancels older unconfirmed versions of the same address. '
  'A version stored again is re-armed if it was cancelled, and left alone if its due signal was sent. '
  'NOTIFYs buzz_reminders unless an armed reminder due more than a second from now, and no later than this one, '
  'already has the schedulers waking in time.';
