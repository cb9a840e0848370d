-- Back to the row locking before 0023: apply_deletion as in 0016 (its comment as in 0021), arm_reminder as in 0017,
-- confirm_reminder_claims and rollback_reminder_claims as in 0022.

CREATE OR REPLACE FUNCTION buzz.apply_deletion(author text, del_id text, del_created_at bigint, p_tags jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  ids text[] := ARRAY(SELECT DISTINCT t FROM unnest(buzz.tag_values(p_tags, 'e')) t
                       WHERE buzz.is_hex64(t) ORDER BY t);
  a record;
  target text;
BEGIN
  FOREACH target IN ARRAY ids LOOP
    PERFORM pg_advisory_xact_lock(hashtextextended('event:' || target, 0));  -- see accept_event
  END LOOP;
  FOR a IN SELECT * FROM buzz.deletion_addresses(author, p_tags) LOOP
    PERFORM pg_advisory_xact_lock(hashtextextended(a.lock_key, 0));          -- see accept_event
  END LOOP;

  FOR a IN SELECT * FROM buzz.deletion_addresses(author, p_tags) LOOP
    DELETE FROM buzz.events e
     WHERE e.kind = a.kind AND e.pubkey = author AND e.created_at <= del_created_at
       AND (buzz.kind_class(a.kind) = 'replaceable' OR e.d_tag = a.d_tag);
    UPDATE buzz.reminders r SET state = 'cancelled', cancelled_at = now(), lease_until = NULL
     WHERE a.kind = 30300 AND r.pubkey = author AND r.d_tag = a.d_tag AND r.created_at <= del_created_at
       AND r.state IN ('armed', 'claimed');
    INSERT INTO buzz.deleted_addresses AS da (kind, pubkey, d_tag, until_created_at)
    VALUES (a.kind, author, a.d_tag, del_created_at)
    ON CONFLICT (kind, pubkey, d_tag) DO UPDATE
      SET until_created_at = greatest(da.until_created_at, EXCLUDED.until_created_at);
  END LOOP;
  FOREACH target IN ARRAY ids LOOP
    DELETE FROM buzz.events WHERE id = target AND pubkey = author AND kind <> 5;
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), lease_until = NULL
     WHERE id = target AND pubkey = author AND state IN ('armed', 'claimed');
    -- A tombstone even for ids not seen yet: the id stays deleted when published later. It is
    -- keyed by (id, deleter): a request naming someone else's id must not take the slot of the
    -- author's own tombstone (only the author's one is honoured by accept_event).
    INSERT INTO buzz.deleted_ids (id, pubkey, deleted_by) VALUES (target, author, del_id)
    ON CONFLICT (id, pubkey) DO NOTHING;
  END LOOP;
END $$;
COMMENT ON FUNCTION buzz.apply_deletion(text, text, bigint, jsonb) IS
  'NIP-09: deletes the author''s own versions of a-tag addresses up to the request''s created_at and events named by e tags (leaving tombstones); cancels affected reminders. Takes every lock first, in acceptance''s order (ids, then addresses, each sorted and taken once), then touches rows. accept_event has already taken the ids, sorted together with the request''s own id; taking them again is harmless (re-entrant).';

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

CREATE OR REPLACE FUNCTION buzz.confirm_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
  flipped text[];
  emitted text[];
  items   text[];
  i       integer;
BEGIN
  IF coalesce(array_length(p_ids, 1), 0) <> coalesce(array_length(p_stamps, 1), 0) THEN
    PERFORM buzz.reject('BZ400', format('invalid: confirm_reminder_claims: %s ids but %s stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0)));
  END IF;
  -- One set-based statement flips the rows still claimed under the given stamps (the fence) and
  -- renders the signal of each whose stored version still exists. Rows are locked in the order
  -- the planner visits them; callers pass ids sorted. The only overlap between two batches is a
  -- stale claimer and its recoverer; should they deadlock, one gets 40P01 and, being a plain
  -- error, emits nothing. Items are rendered as json text, not jsonb: aggregating a megabyte of
  -- jsonb doubled the cost of a 1,000-row confirm.
  WITH c AS (
    UPDATE buzz.reminders x
       SET state = 'confirmed', confirmed_at = clock_timestamp(), lease_until = NULL
      FROM unnest(p_ids, p_stamps) AS u(id, stamp)
     WHERE x.id = u.id AND x.stamp = u.stamp AND x.state = 'claimed'
    RETURNING x.id, x.stamp
  )
  SELECT array_agg(c.id),
         array_agg(c.id) FILTER (WHERE e.id IS NOT NULL),
         array_agg(json_build_object(
             'ev', json_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                                     'tags', e.tags, 'content', e.content, 'sig', e.sig),
             'stamp', c.stamp)::text) FILTER (WHERE e.id IS NOT NULL)
    INTO flipped, emitted, items
    FROM c LEFT JOIN buzz.events e ON e.id = c.id;
  -- One message per 100 signals: a hundredth of the walsender and relay wake-ups of one message
  -- per signal, and messages small enough to decode without a megabyte buffer.
  FOR i IN 1 .. coalesce(array_length(items, 1), 0) BY 100 LOOP
    PERFORM pg_logical_emit_message(true, 'buzz',
      '{"t":"dues","scope":"a","items":[' || array_to_string(items[i:i + 99], ',') || ']}');
  END LOOP;
  -- A flipped row whose stored version is gone (removed by hand) had nothing to deliver.
  IF coalesce(array_length(flipped, 1), 0) > coalesce(array_length(emitted, 1), 0) THEN
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), confirmed_at = NULL
     WHERE id = ANY (flipped) AND NOT (id = ANY (coalesce(emitted, '{}')));
  END IF;
  RETURN QUERY SELECT unnest(coalesce(emitted, '{}'));
END $$;
COMMENT ON FUNCTION buzz.confirm_reminder_claims(text[], bigint[]) IS
  'Batch confirm_reminder_claim: for each (id, stamp) pair still claimed under that stamp, marks it confirmed and '
  'emits its due signal, all in the caller''s transaction, as transactional logical messages ''buzz'' of up to 100 '
  'signals each: {"t":"dues","scope":"a","items":[{"ev":<the 30300>,"stamp":..}, ...]}. Returns the confirmed ids. '
  'Pairs with a stale stamp emit nothing. Raises BZ400 (invalid:), changing and emitting nothing, when there are '
  'not as many stamps as ids.';

CREATE OR REPLACE FUNCTION buzz.rollback_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
  r record;
BEGIN
  IF coalesce(array_length(p_ids, 1), 0) <> coalesce(array_length(p_stamps, 1), 0) THEN
    PERFORM buzz.reject('BZ400', format('invalid: rollback_reminder_claims: %s ids but %s stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0)));
  END IF;
  FOR r IN
    UPDATE buzz.reminders x
       SET state = 'armed', lease_until = NULL, rollbacks = x.rollbacks + 1
      FROM unnest(p_ids, p_stamps) AS u(id, stamp)
     WHERE x.id = u.id AND x.stamp = u.stamp AND x.state = 'claimed'
    RETURNING x.id, x.not_before
  LOOP
    PERFORM pg_notify('buzz_reminders', r.not_before::text);
    RETURN NEXT r.id;
  END LOOP;
END $$;
COMMENT ON FUNCTION buzz.rollback_reminder_claims(text[], bigint[]) IS
  'Batch rollback_reminder_claim (graceful shutdown, failed batch confirm): each (id, stamp) pair still claimed '
  'under that stamp goes back to armed; returns the ids rolled back. Stale pairs change nothing. Raises BZ400 '
  '(invalid:), changing nothing, when there are not as many stamps as ids.';
