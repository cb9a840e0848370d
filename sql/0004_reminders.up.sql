-- NIP-ER reminders: arming on acceptance, the scheduler's claims (stamps and leases), confirms
-- that emit the due signal, rollbacks, and the operator views.
--
-- I5: one winner of concurrent claims; a stale stamp changes nothing; stamps are unique.
-- Row-lock order: buzz.events rows, then buzz.reminders rows, each by id. A writer of several
-- rows locks the whole set first (SELECT ... ORDER BY id FOR UPDATE), then writes. Claims never
-- wait (FOR UPDATE SKIP LOCKED), so they close no cycle.

-- NIP-ER validation (docs/protocol.md): returns not_before (NULL when absent).
CREATE FUNCTION buzz.validate_reminder(tags jsonb, expires bigint) RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  ds text[] := buzz.tag_values(tags, 'd');
  nbs text[] := buzz.tag_values(tags, 'not_before');
  nb numeric;
BEGIN
  -- A not_before tag without a value is malformed, not absent.
  IF EXISTS (SELECT 1 FROM jsonb_array_elements(tags) t WHERE t->>0 = 'not_before' AND jsonb_array_length(t) < 2) THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed not_before');
  END IF;
  IF coalesce(array_length(ds, 1), 0) <> 1 OR ds[1] = '' THEN
    PERFORM buzz.reject('BZ400', 'invalid: missing d tag');
  END IF;
  IF coalesce(array_length(nbs, 1), 0) = 0 THEN
    RETURN NULL;
  END IF;
  IF array_length(nbs, 1) > 1 OR nbs[1] !~ '^(0|[1-9][0-9]{0,15})$' THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed not_before');
  END IF;
  nb := nbs[1]::numeric;
  IF nb > 9007199254740991 THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed not_before');
  END IF;
  IF nb > buzz.now_unix() + coalesce(buzz.cfg('reminder_horizon_seconds'), '31536000')::bigint THEN
    PERFORM buzz.reject('BZ400', 'invalid: not_before too far in future');
  END IF;
  IF expires IS NOT NULL AND expires <= nb THEN
    PERFORM buzz.reject('BZ400', 'invalid: expiration before not_before');
  END IF;
  RETURN nb::bigint;
END $$;
COMMENT ON FUNCTION buzz.validate_reminder(jsonb, bigint) IS
  'Checks a kind 30300 reminder''s tags (one non-empty d, at most one canonical not_before within the horizon, expiration after not_before); returns not_before or NULL.';

CREATE FUNCTION buzz.arm_reminder(p_id text, p_pubkey text, p_d text, p_created_at bigint,
                                             p_not_before bigint, p_expires bigint) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- Row locks in the one order: every row written below, by id. An address has one unconfirmed
  -- version unless rows were changed by hand, but then the cancel would lock them in the address
  -- index's order.
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
  'locking those rows and its own first, by id (the one row order). '
  'A version stored again is re-armed if it was cancelled, and left alone if its due signal was sent. '
  'NOTIFYs buzz_reminders unless an armed reminder due more than a second from now, and no later than this one, '
  'already has the schedulers waking in time.';

CREATE FUNCTION buzz.reminder_event_json(p_id text) RETURNS jsonb
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN (SELECT jsonb_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                                    'tags', e.tags, 'content', e.content, 'sig', e.sig)
            FROM buzz.events e WHERE e.id = p_id);
END $$;
COMMENT ON FUNCTION buzz.reminder_event_json(text) IS
  'The stored event p_id as a nostr JSON object (id, pubkey, created_at, kind, tags, content, sig), or NULL.';

-------------------------------------------------------------------------------------------------
-- Claims, confirms and rollbacks.

CREATE FUNCTION buzz.claim_due_reminders(p_max integer, p_lease interval, p_with_event boolean DEFAULT true,
                                         p_only text[] DEFAULT NULL)
RETURNS TABLE (id text, pubkey text, created_at bigint, not_before bigint, stamp bigint,
               recovered boolean, ev jsonb)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  t bigint := floor(extract(epoch FROM now()))::bigint;
BEGIN
  -- LIMIT NULL is no limit (and greatest() skips the NULL: every expired lease, no due row).
  IF p_max IS NULL OR p_max < 0 THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_max must be 0 or more');
  END IF;
  -- A claim without a lease is never recovered (a table constraint refuses it too, on any write).
  IF p_lease IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_lease is NULL (a claim without a lease is never recovered)');
  END IF;
  IF p_with_event IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_with_event must be true or false');
  END IF;
  RETURN QUERY
  WITH stuck AS (            -- claims whose owner neither confirmed nor rolled back within the lease
    SELECT x.id FROM buzz.reminders x
     WHERE x.state = 'claimed' AND x.lease_until < now()
       AND (p_only IS NULL OR x.id = ANY (p_only))
     ORDER BY x.lease_until
     LIMIT p_max FOR UPDATE SKIP LOCKED
  ), due AS (                -- oldest due first; locks only as many as the batch still has room for
    SELECT x.id FROM buzz.reminders x
     WHERE x.state = 'armed' AND x.not_before <= t
       AND (p_only IS NULL OR x.id = ANY (p_only))
     ORDER BY x.not_before
     LIMIT greatest(p_max - (SELECT count(*) FROM stuck), 0) FOR UPDATE SKIP LOCKED
  ), upd AS (
    -- = ANY(ARRAY(...)): primary-key lookups of exactly the locked rows, whatever the table size.
    -- Versions whose NIP-40 expiration passed before delivery are never due: they are cancelled
    -- here (this is their housekeeping) and not returned.
    UPDATE buzz.reminders r
       SET state = CASE WHEN r.expires_at <= t THEN 'cancelled' ELSE 'claimed' END,
           cancelled_at = CASE WHEN r.expires_at <= t THEN now() END,
           stamp = CASE WHEN r.expires_at <= t THEN r.stamp ELSE nextval('buzz.reminder_stamp_seq') END,
           claimed_at = clock_timestamp(),
           lease_until = CASE WHEN r.expires_at <= t THEN NULL ELSE clock_timestamp() + p_lease END,
           claims = r.claims + 1,
           recoveries = r.recoveries + CASE WHEN r.state = 'claimed' THEN 1 ELSE 0 END
     WHERE r.id = ANY (ARRAY(SELECT s.id FROM stuck s UNION ALL SELECT d.id FROM due d))
    RETURNING r.id, r.pubkey, r.created_at, r.not_before, r.stamp, r.state
  )
  SELECT u.id, u.pubkey, u.created_at, u.not_before, u.stamp,
         EXISTS (SELECT 1 FROM stuck s WHERE s.id = u.id),   -- re-took an expired lease
         CASE WHEN p_with_event THEN buzz.reminder_event_json(u.id) END
    FROM upd u
   WHERE u.state = 'claimed'
   ORDER BY u.not_before, u.id;
END $$;
COMMENT ON FUNCTION buzz.claim_due_reminders(integer, interval, boolean, text[]) IS
  'Scheduler batch claim: up to p_max due reminder versions (expired leases first, then armed rows by not_before), '
  'FOR UPDATE SKIP LOCKED so concurrent schedulers take disjoint sets, each with a fresh stamp and a lease of '
  'p_lease. Returns the claims, with the stored event as JSON unless p_with_event is false (the scheduler does not '
  'need it: confirm builds the due signal). Versions whose NIP-40 expiration passed before delivery are cancelled '
  'instead of claimed. p_only, when not NULL, limits the claim to those reminder ids. Raises BZ400 (invalid:), '
  'claiming nothing, for a NULL or negative p_max, a NULL p_lease or a NULL p_with_event.';

-- The seed's single-row API, a wrapper of the batch claim, so that its tests exercise the
-- scheduler's code. The batch skips locked rows; this waits for the row instead, so of two
-- concurrent claims the loser sees the winner's claim and gets NULL (I5).
CREATE FUNCTION buzz.claim_due_reminder(p_id text, p_created_at bigint, p_lease interval DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- (id, created_at) names the version.
  PERFORM 1 FROM buzz.reminders r WHERE r.id = p_id AND r.created_at = p_created_at FOR UPDATE;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;
  RETURN (SELECT c.stamp
            FROM buzz.claim_due_reminders(1, coalesce(p_lease, make_interval(
                   secs => coalesce(buzz.cfg('reminder_lease_seconds'), '30')::double precision)),
                 false, ARRAY[p_id]) c);
END $$;
COMMENT ON FUNCTION buzz.claim_due_reminder(text, bigint, interval) IS
  'Claims one due reminder version: returns a fresh stamp (unique per claim, from buzz.reminder_stamp_seq) and '
  'sets a lease (p_lease, default config reminder_lease_seconds), or NULL when it is not due, expired, cancelled, '
  'confirmed, or someone else holds an unexpired claim. An expired lease is re-taken with a new stamp (counted in '
  'recoveries), which fences the previous claimer out of confirm and rollback. Waits for a row another transaction '
  'holds. A wrapper of claim_due_reminders: a due version whose expiration passed is cancelled, as there.';

-- Items are rendered as json text, not jsonb: aggregating a megabyte of jsonb doubled the cost
-- of a 1,000-row confirm.
CREATE FUNCTION buzz.confirm_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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
  -- subquery u, by id (the one row order), whatever order the caller passes them in and
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
  'Pairs with a stale stamp emit nothing and are not locked. Locks the rows it confirms by id (the one row '
  'order), whatever the order of p_ids. Raises BZ400 (invalid:), changing and emitting nothing, when there are '
  'not as many stamps as ids.';

CREATE FUNCTION buzz.confirm_reminder_claim(p_id text, p_created_at bigint, p_stamp bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  ev jsonb;
BEGIN
  -- The fence: lock the row and flip it only while it is claimed under our stamp. A lease that
  -- expired but was not re-taken still confirms: the stamp proves nobody else can emit.
  UPDATE buzz.reminders r
     SET state = 'confirmed', confirmed_at = clock_timestamp(), lease_until = NULL
   WHERE r.id = p_id AND r.created_at = p_created_at AND r.stamp = p_stamp AND r.state = 'claimed';
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  ev := buzz.reminder_event_json(p_id);
  IF ev IS NULL THEN
    -- The stored version is gone (removed by hand): nothing to deliver.
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), confirmed_at = NULL
     WHERE id = p_id;
    RETURN false;
  END IF;
  PERFORM pg_logical_emit_message(true, 'buzz', jsonb_build_object(
    't', 'due', 'ev', ev, 'stamp', p_stamp, 'scope', 'a')::text);
  RETURN true;
END $$;
COMMENT ON FUNCTION buzz.confirm_reminder_claim(text, bigint, bigint) IS
  'Emits the due signal (transactional logical message ''buzz'': {"t":"due","ev":<the 30300>,"stamp":..,"scope":"a"}) '
  'and marks the reminder confirmed, in the caller''s transaction, only while it is claimed under p_stamp; '
  'returns false and emits nothing otherwise. The message exists iff this transaction commits.';

CREATE FUNCTION buzz.rollback_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  r record;
BEGIN
  IF coalesce(array_length(p_ids, 1), 0) <> coalesce(array_length(p_stamps, 1), 0) THEN
    PERFORM buzz.reject('BZ400', format('invalid: rollback_reminder_claims: %s ids but %s stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0)));
  END IF;
  -- The rows are locked by the subquery u, by id (the one row order), as in
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
  'Locks the rows it rolls back by id (the one row order), whatever the order of p_ids. Raises BZ400 '
  '(invalid:), changing nothing, when there are not as many stamps as ids.';

-- The seed's single-row API, a wrapper of the batch rollback (the scheduler's code).
CREATE FUNCTION buzz.rollback_reminder_claim(p_id text, p_created_at bigint, p_stamp bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- (id, created_at) names the version; a pair that names none changes nothing.
  IF NOT EXISTS (SELECT 1 FROM buzz.reminders r WHERE r.id = p_id AND r.created_at = p_created_at) THEN
    RETURN false;
  END IF;
  RETURN EXISTS (SELECT 1 FROM buzz.rollback_reminder_claims(ARRAY[p_id], ARRAY[p_stamp]));
END $$;
COMMENT ON FUNCTION buzz.rollback_reminder_claim(text, bigint, bigint) IS
  'Undoes a claim that was not confirmed: back to armed only while the row is still claimed under p_stamp. '
  'Returns false and changes nothing otherwise (stale stamp, confirmed, cancelled, already rolled back). '
  'A wrapper of rollback_reminder_claims.';

-------------------------------------------------------------------------------------------------
-- Operators and the scheduler's sleep.

CREATE FUNCTION buzz.reminder_status()
RETURNS TABLE (armed bigint, due bigint, claimed bigint, stuck bigint, confirmed bigint, cancelled bigint,
               recovered bigint, oldest_due_lateness interval, next_not_before bigint)
LANGUAGE sql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
  WITH c AS (SELECT floor(extract(epoch FROM now()))::bigint AS t)
  SELECT count(*) FILTER (WHERE r.state = 'armed' AND r.not_before > c.t),
         count(*) FILTER (WHERE r.state = 'armed' AND r.not_before <= c.t
                            AND (r.expires_at IS NULL OR r.expires_at > c.t)),
         count(*) FILTER (WHERE r.state = 'claimed'),
         count(*) FILTER (WHERE r.state = 'claimed' AND r.lease_until < now()),
         count(*) FILTER (WHERE r.state = 'confirmed'),
         count(*) FILTER (WHERE r.state = 'cancelled'),
         coalesce(sum(r.recoveries), 0)::bigint,
         now() - to_timestamp(min(r.not_before) FILTER (
                   WHERE r.state IN ('armed', 'claimed') AND r.not_before <= c.t)),
         min(r.not_before) FILTER (WHERE r.state = 'armed' AND r.not_before > c.t)
    FROM buzz.reminders r, c
$$;
COMMENT ON FUNCTION buzz.reminder_status() IS
  'Operator view of reminders: armed (not yet due), due (armed, not_before passed, not expired), claimed, stuck '
  '(claimed past the lease: its owner died; a scheduler sweep recovers it), confirmed, cancelled, recovered (total '
  're-taken leases), the lateness of the oldest undelivered due reminder, and the next not_before.';

-- Where the scheduler should sleep until: the earliest armed not_before and the earliest lease
-- expiry (both from partial indexes).
CREATE FUNCTION buzz.next_reminder_wakeup(OUT next_not_before bigint, OUT next_lease_expiry timestamptz,
                                          OUT db_now timestamptz)
LANGUAGE sql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
  SELECT (SELECT min(not_before) FROM buzz.reminders WHERE state = 'armed'),
         (SELECT min(lease_until) FROM buzz.reminders WHERE state = 'claimed'),
         clock_timestamp()
$$;
COMMENT ON FUNCTION buzz.next_reminder_wakeup() IS
  'The earliest armed not_before (unix seconds), the earliest claim lease expiry, and the database clock: what '
  'a scheduler sleeps until.';

REVOKE ALL ON FUNCTION buzz.reminder_event_json(text), buzz.claim_due_reminder(text, bigint, interval),
  buzz.claim_due_reminders(integer, interval, boolean, text[]), buzz.rollback_reminder_claim(text, bigint, bigint),
  buzz.rollback_reminder_claims(text[], bigint[]), buzz.confirm_reminder_claim(text, bigint, bigint),
  buzz.confirm_reminder_claims(text[], bigint[]), buzz.reminder_status(), buzz.next_reminder_wakeup() FROM PUBLIC;
