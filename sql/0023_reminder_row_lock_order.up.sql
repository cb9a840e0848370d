-- One row-lock order for buzz.reminders (and for buzz.events rows beside them), followed by
-- every writer that locks more than one row.
--
-- A NIP-09 deletion cancelled reminder rows address by address (in lock-key order) and then id
-- by id, so it locked them in an order that is not id order. The scheduler's batch confirm and
-- rollback updated their rows in one statement in whatever order the plan visited them. A
-- deletion cancelling R_b (by address) and then R_a (by id, a < b) beside a batch confirm of
-- [R_a, R_b] deadlocked: the confirm held R_a and waited for R_b, the deletion held R_b and
-- waited for R_a, and PostgreSQL broke the cycle with 40P01 after deadlock_timeout (1 s).
--
-- The order, after the advisory locks (event:<id>, then addresses; see accept_event and 0016):
--   1. buzz.events rows, by id;
--   2. buzz.reminders rows, by id.
-- A writer of several rows locks the whole set first (SELECT ... ORDER BY id FOR UPDATE), then
-- writes. Events rows come first because accept_event already does it that way: it locks the
-- head version of an address (SELECT ... FOR UPDATE, one row), deletes it and only then arms
-- the reminder (arm_reminder). Who follows it:
--   apply_deletion           locks the events rows it deletes, then the reminder rows it cancels,
--                            each set by id, before it touches any row (it used to interleave
--                            events and reminders per target, in address then id order);
--   arm_reminder             locks the versions it cancels and its own row (the upsert) by id;
--   confirm_reminder_claims  lock the rows still claimed under the given stamps by id, in a
--   rollback_reminder_claims locking subquery the UPDATE joins, instead of the plan's order.
-- Needing nothing: claim_due_reminder, confirm_reminder_claim and rollback_reminder_claim touch
-- one row; claim_due_reminders never waits (FOR UPDATE SKIP LOCKED), so it closes no cycle; the
-- claims and confirms read events rows (the due signal) without locking them.
-- The stamp fences are unchanged: the locking subqueries select exactly the rows the fence
-- accepts (id, stamp, state 'claimed'), re-checked once a lock is granted, and the UPDATEs keep
-- their own fence. A row the fence turns away when the statement starts is neither locked nor
-- waited for, as before; one a concurrent transaction is changing is waited for, then dropped by
-- the re-check.

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

  -- Row locks in the one order (sql/0023): the events rows the deletes below remove, by id, then
  -- the reminder rows the cancels below change, by id. Each set is exactly what the statements
  -- below match; a row changed meanwhile is re-checked when its lock is granted.
  PERFORM 1 FROM buzz.events e
   WHERE e.id IN (SELECT x.id FROM buzz.deletion_addresses(author, p_tags) ad
                    JOIN buzz.events x ON x.kind = ad.kind AND x.pubkey = author
                                      AND x.created_at <= del_created_at
                                      AND (buzz.kind_class(ad.kind) = 'replaceable' OR x.d_tag = ad.d_tag)
                  UNION ALL
                  SELECT x.id FROM buzz.events x WHERE x.id = ANY (ids) AND x.pubkey = author AND x.kind <> 5)
   ORDER BY e.id
     FOR UPDATE OF e;
  PERFORM 1 FROM buzz.reminders r
   WHERE r.pubkey = author AND r.state IN ('armed', 'claimed')
     AND (r.id = ANY (ids)
          OR (r.created_at <= del_created_at
              AND r.d_tag IN (SELECT ad.d_tag FROM buzz.deletion_addresses(author, p_tags) ad
                               WHERE ad.kind = 30300)))
   ORDER BY r.id
     FOR UPDATE OF r;

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
  'NIP-09: deletes the author''s own versions of a-tag addresses up to the request''s created_at and events named by e tags (leaving tombstones); cancels affected reminders. Takes every lock first: the advisory locks in acceptance''s order (ids, then addresses, each sorted and taken once; accept_event has already taken the ids with the request''s own, sql/0021), then the row locks in the one row order (sql/0023: the events rows it deletes, then the reminder rows it cancels, each by id); then touches rows.';

CREATE OR REPLACE FUNCTION buzz.arm_reminder(p_id text, p_pubkey text, p_d text, p_created_at bigint,
                                             p_not_before bigint, p_expires bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  -- Row locks in the one order (sql/0023): every row written below, by id. An address has one
  -- unconfirmed version unless rows were changed by hand, but then the cancel would lock them in
  -- the address index's order.
  PERFORM 1 FROM buzz.reminders r
   WHERE (r.pubkey = p_pubkey AND r.d_tag = p_d AND r.state IN ('armed', 'claimed')) OR r.id = p_id
   ORDER BY r.id
     FOR UPDATE;
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
  'Arms the reminder row of a new 30300 version and cancels older unconfirmed versions of the same address, '
  'locking those rows and its own first, by id (the row order of sql/0023). '
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
  -- renders the signal of each whose stored version still exists. The rows are locked by the
  -- subquery u, by id (the row order of sql/0023), whatever order the caller passes them in and
  -- the plan visits them: the UPDATE only writes rows u has locked. u selects the rows the fence
  -- accepts, re-checked once a lock is granted, so a pair already stale is neither locked nor waited for.
  -- Items are rendered as json text, not jsonb: aggregating a megabyte of jsonb doubled the cost
  -- of a 1,000-row confirm.
  WITH c AS (
    UPDATE buzz.reminders x
       SET state = 'confirmed', confirmed_at = clock_timestamp(), lease_until = NULL
      FROM (SELECT l.id, v.stamp
              FROM buzz.reminders l JOIN unnest(p_ids, p_stamps) AS v(id, stamp)
                ON l.id = v.id AND l.stamp = v.stamp
             WHERE l.state = 'claimed'
             ORDER BY l.id
               FOR UPDATE OF l) AS u
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
  'Pairs with a stale stamp emit nothing and are not locked. Locks the rows it confirms by id (the row order of '
  'sql/0023), whatever the order of p_ids. Raises BZ400 (invalid:), changing and emitting nothing, when there are '
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
  -- The rows are locked by the subquery u, by id (the row order of sql/0023), as in
  -- confirm_reminder_claims; u selects the rows the fence accepts.
  FOR r IN
    UPDATE buzz.reminders x
       SET state = 'armed', lease_until = NULL, rollbacks = x.rollbacks + 1
      FROM (SELECT l.id, v.stamp
              FROM buzz.reminders l JOIN unnest(p_ids, p_stamps) AS v(id, stamp)
                ON l.id = v.id AND l.stamp = v.stamp
             WHERE l.state = 'claimed'
             ORDER BY l.id
               FOR UPDATE OF l) AS u
     WHERE x.id = u.id AND x.stamp = u.stamp AND x.state = 'claimed'
    RETURNING x.id, x.not_before
  LOOP
    PERFORM pg_notify('buzz_reminders', r.not_before::text);
    RETURN NEXT r.id;
  END LOOP;
END $$;
COMMENT ON FUNCTION buzz.rollback_reminder_claims(text[], bigint[]) IS
  'Batch rollback_reminder_claim (graceful shutdown, failed batch confirm): each (id, stamp) pair still claimed '
  'under that stamp goes back to armed; returns the ids rolled back. Stale pairs change nothing and are not locked. '
  'Locks the rows it rolls back by id (the row order of sql/0023), whatever the order of p_ids. Raises BZ400 '
  '(invalid:), changing nothing, when there are not as many stamps as ids.';
