-- NIP-ER reminder scheduling (DESIGN.md invariants I5, I6). accept_event (0002) arms a row per
-- reminder version; these functions move it armed -> claimed -> confirmed.
--
--   claim     a single UPDATE guarded by the state (atomic: of concurrent claims exactly one wins)
--             hands out a fresh stamp from buzz.reminder_stamp_seq and a lease.
--   confirm   emits the due signal and marks the row confirmed in ONE transaction, only while the
--             row is still claimed under the caller's stamp. Emission is a transactional logical
--             message, so it exists iff the confirm commits: at most one confirm per version can
--             commit, hence the signal is emitted exactly once per version.
--   rollback  returns the row to armed only while it is still claimed under the caller's stamp:
--             a stale claimer (whose lease was recovered by someone else) changes nothing.
--   recovery  a claim neither confirmed nor rolled back within its lease (its owner died) is
--             re-taken with a NEW stamp, which fences the old owner out of confirm and rollback.
--
-- Times: "due" means not_before <= the database clock in whole seconds (to_timestamp(not_before)
-- <= now()). Functions use now(), i.e. the start of the caller's transaction; the scheduler calls
-- them in short autocommit transactions. An expired version (NIP-40 expiration passed) is never
-- due; the batch claim cancels such rows so they leave the due index.
-- Lock order: only buzz.reminders rows, one at a time or SKIP LOCKED, so claims cannot deadlock;
-- batch confirms lock in id order.

INSERT INTO buzz.config(key, value) VALUES ('reminder_lease_seconds', '30')
ON CONFLICT (key) DO NOTHING;

-- The due signal's payload: the stored 30300 as a nostr JSON object (the fan-out tail decodes it).
CREATE FUNCTION buzz.reminder_event_json(p_id text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
  SELECT jsonb_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                            'tags', e.tags, 'content', e.content, 'sig', e.sig)
    FROM buzz.events e WHERE e.id = p_id
$$;
COMMENT ON FUNCTION buzz.reminder_event_json(text) IS
  'The stored event p_id as a nostr JSON object (id, pubkey, created_at, kind, tags, content, sig), or NULL.';

-------------------------------------------------------------------------------------------------
CREATE FUNCTION buzz.claim_due_reminder(p_id text, p_created_at bigint, p_lease interval DEFAULT NULL)
RETURNS bigint
LANGUAGE sql AS $$
  -- One statement: under READ COMMITTED a concurrent claimer blocks on the row lock and then
  -- re-checks the WHERE clause against the winner's version (state='claimed', lease in the
  -- future), so it updates nothing and gets NULL.
  UPDATE buzz.reminders r
     SET state = 'claimed',
         stamp = nextval('buzz.reminder_stamp_seq'),
         claimed_at = clock_timestamp(),
         lease_until = clock_timestamp()
                       + coalesce(p_lease, make_interval(secs => coalesce(buzz.cfg('reminder_lease_seconds'), '30')::double precision)),
         claims = r.claims + 1,
         recoveries = r.recoveries + CASE WHEN r.state = 'claimed' THEN 1 ELSE 0 END
   WHERE r.id = p_id AND r.created_at = p_created_at
     AND r.not_before <= floor(extract(epoch FROM now()))::bigint
     AND (r.expires_at IS NULL OR r.expires_at > floor(extract(epoch FROM now()))::bigint)
     AND (r.state = 'armed' OR (r.state = 'claimed' AND r.lease_until < now()))
  RETURNING r.stamp
$$;
COMMENT ON FUNCTION buzz.claim_due_reminder(text, bigint, interval) IS
  'Claims one due reminder version: returns a fresh stamp (unique per claim, from buzz.reminder_stamp_seq) and '
  'sets a lease (p_lease, default config reminder_lease_seconds), or NULL when it is not due, expired, cancelled, '
  'confirmed, or someone else holds an unexpired claim. An expired lease is re-taken with a new stamp (counted in '
  'recoveries), which fences the previous claimer out of confirm and rollback.';

-------------------------------------------------------------------------------------------------
CREATE FUNCTION buzz.claim_due_reminders(p_max integer, p_lease interval, p_with_event boolean DEFAULT true)
RETURNS TABLE (id text, pubkey text, created_at bigint, not_before bigint, stamp bigint,
               recovered boolean, ev jsonb)
LANGUAGE plpgsql AS $$
DECLARE
  t bigint := floor(extract(epoch FROM now()))::bigint;
BEGIN
  RETURN QUERY
  WITH stuck AS (            -- claims whose owner neither confirmed nor rolled back within the lease
    SELECT x.id FROM buzz.reminders x
     WHERE x.state = 'claimed' AND x.lease_until < now()
     ORDER BY x.lease_until
     LIMIT p_max FOR UPDATE SKIP LOCKED
  ), due AS (                -- oldest due first; locks only as many as the batch still has room for
    SELECT x.id FROM buzz.reminders x
     WHERE x.state = 'armed' AND x.not_before <= t
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
COMMENT ON FUNCTION buzz.claim_due_reminders(integer, interval, boolean) IS
  'Scheduler batch claim: up to p_max due reminder versions (expired leases first, then armed rows by not_before), '
  'FOR UPDATE SKIP LOCKED so concurrent schedulers take disjoint sets, each with a fresh stamp and a lease of '
  'p_lease. Returns the claims, with the stored event as JSON unless p_with_event is false (the scheduler does not '
  'need it: confirm builds the due signal). Versions whose NIP-40 expiration passed before delivery are cancelled '
  'instead of claimed.';

-------------------------------------------------------------------------------------------------
CREATE FUNCTION buzz.rollback_reminder_claim(p_id text, p_created_at bigint, p_stamp bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
  nb bigint;
BEGIN
  -- Guarded by the stamp AND the state: a stale claimer (row re-claimed, confirmed, cancelled or
  -- already rolled back) changes nothing.
  UPDATE buzz.reminders r
     SET state = 'armed', lease_until = NULL, rollbacks = r.rollbacks + 1
   WHERE r.id = p_id AND r.created_at = p_created_at AND r.stamp = p_stamp AND r.state = 'claimed'
  RETURNING r.not_before INTO nb;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  -- It is due again right away: wake schedulers (another process may take it sooner).
  PERFORM pg_notify('buzz_reminders', nb::text);
  RETURN true;
END $$;
COMMENT ON FUNCTION buzz.rollback_reminder_claim(text, bigint, bigint) IS
  'Undoes a claim that was not confirmed: back to armed only while the row is still claimed under p_stamp. '
  'Returns false and changes nothing otherwise (stale stamp, confirmed, cancelled, already rolled back).';

CREATE FUNCTION buzz.rollback_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
  r record;
BEGIN
  IF coalesce(array_length(p_ids, 1), 0) <> coalesce(array_length(p_stamps, 1), 0) THEN
    RAISE EXCEPTION 'rollback_reminder_claims: % ids but % stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0);
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
  'under that stamp goes back to armed; returns the ids rolled back. Stale pairs change nothing.';

-------------------------------------------------------------------------------------------------
CREATE FUNCTION buzz.confirm_reminder_claim(p_id text, p_created_at bigint, p_stamp bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
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

CREATE FUNCTION buzz.confirm_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
  flipped text[];
  emitted text[];
BEGIN
  IF coalesce(array_length(p_ids, 1), 0) <> coalesce(array_length(p_stamps, 1), 0) THEN
    RAISE EXCEPTION 'confirm_reminder_claims: % ids but % stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0);
  END IF;
  -- One set-based statement: flip the rows still claimed under the given stamps (the fence) and
  -- emit one due message for each. Rows are locked in the order the planner visits them; callers
  -- pass ids sorted. The only overlap between two batches is a stale claimer and its recoverer;
  -- should they deadlock, one gets 40P01 and, being a plain error, emits nothing.
  WITH c AS (
    UPDATE buzz.reminders x
       SET state = 'confirmed', confirmed_at = clock_timestamp(), lease_until = NULL
      FROM unnest(p_ids, p_stamps) AS u(id, stamp)
     WHERE x.id = u.id AND x.stamp = u.stamp AND x.state = 'claimed'
    RETURNING x.id, x.stamp
  ), m AS (
    SELECT c.id, pg_logical_emit_message(true, 'buzz', jsonb_build_object(
             't', 'due',
             'ev', jsonb_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                                      'tags', e.tags, 'content', e.content, 'sig', e.sig),
             'stamp', c.stamp, 'scope', 'a')::text) AS lsn
      FROM c JOIN buzz.events e ON e.id = c.id
  )
  SELECT (SELECT array_agg(c.id) FROM c), (SELECT array_agg(m.id) FROM m WHERE m.lsn IS NOT NULL)
    INTO flipped, emitted;
  -- A flipped row whose stored version is gone (removed by hand) had nothing to deliver.
  IF coalesce(array_length(flipped, 1), 0) > coalesce(array_length(emitted, 1), 0) THEN
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), confirmed_at = NULL
     WHERE id = ANY (flipped) AND NOT (id = ANY (coalesce(emitted, '{}')));
  END IF;
  RETURN QUERY SELECT unnest(coalesce(emitted, '{}'));
END $$;
COMMENT ON FUNCTION buzz.confirm_reminder_claims(text[], bigint[]) IS
  'Batch confirm_reminder_claim: for each (id, stamp) pair still claimed under that stamp, emits the due signal '
  'and marks it confirmed, all in the caller''s transaction; returns the confirmed ids. Pairs with a stale stamp '
  'emit nothing.';

-------------------------------------------------------------------------------------------------
CREATE FUNCTION buzz.reminder_status()
RETURNS TABLE (armed bigint, due bigint, claimed bigint, stuck bigint, confirmed bigint, cancelled bigint,
               recovered bigint, oldest_due_lateness interval, next_not_before bigint)
LANGUAGE sql STABLE AS $$
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

-------------------------------------------------------------------------------------------------
-- Where the scheduler should sleep until: the earliest armed not_before and the earliest lease
-- expiry (both from partial indexes).
CREATE FUNCTION buzz.next_reminder_wakeup(OUT next_not_before bigint, OUT next_lease_expiry timestamptz,
                                          OUT db_now timestamptz)
LANGUAGE sql STABLE AS $$
  SELECT (SELECT min(not_before) FROM buzz.reminders WHERE state = 'armed'),
         (SELECT min(lease_until) FROM buzz.reminders WHERE state = 'claimed'),
         clock_timestamp()
$$;
COMMENT ON FUNCTION buzz.next_reminder_wakeup() IS
  'The earliest armed not_before (unix seconds), the earliest claim lease expiry, and the database clock: what '
  'a scheduler sleeps until.';

REVOKE ALL ON FUNCTION buzz.reminder_event_json(text), buzz.claim_due_reminder(text, bigint, interval),
  buzz.claim_due_reminders(integer, interval, boolean), buzz.rollback_reminder_claim(text, bigint, bigint),
  buzz.rollback_reminder_claims(text[], bigint[]), buzz.confirm_reminder_claim(text, bigint, bigint), buzz.confirm_reminder_claims(text[], bigint[]),
  buzz.reminder_status(), buzz.next_reminder_wakeup() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION buzz.reminder_event_json(text), buzz.claim_due_reminder(text, bigint, interval),
  buzz.claim_due_reminders(integer, interval, boolean), buzz.rollback_reminder_claim(text, bigint, bigint),
  buzz.rollback_reminder_claims(text[], bigint[]), buzz.confirm_reminder_claim(text, bigint, bigint), buzz.confirm_reminder_claims(text[], bigint[]),
  buzz.reminder_status(), buzz.next_reminder_wakeup() TO buzz_relay, buzz_operator;
