-- Back to the definitions before 0022: the functions take NULL and malformed arguments again
-- (publish_visibility_snapshot(s), visibility_source and claim_visibility_work from 0003/0008,
-- set_dm_hidden from 0002, the reminder batches from 0004/0006, retire_generation from 0011,
-- visibility_lag_detail from 0003, instance_heartbeat and reap_instances from 0005), each with
-- its comment of then. set_dm_hidden had none.

-------------------------------------------------------------------------------------------------
-- 0003
CREATE OR REPLACE FUNCTION buzz.publish_visibility_snapshot(viewer text, generation bigint, ev jsonb)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  v text := viewer;
  g bigint := generation;
  e_id text := ev->>'id';
  e_created bigint;
  e_tags jsonb := ev->'tags';
  relay_pk text := coalesce(buzz.cfg('relay_pubkey'), '');
  ahead bigint := coalesce(buzz.cfg('snapshot_max_ahead_seconds'), '10')::bigint;
  old_gen bigint;
  head_created bigint;
BEGIN
  -- Shape first (no locks taken yet).
  IF jsonb_typeof(ev) IS DISTINCT FROM 'object' OR NOT buzz.is_hex64(e_id)
     OR (ev->>'sig') !~ '^[0-9a-f]{128}$' OR jsonb_typeof(ev->'created_at') IS DISTINCT FROM 'number'
     OR (ev->>'created_at') !~ '^[0-9]{1,16}$' OR jsonb_typeof(e_tags) IS DISTINCT FROM 'array'
     OR NOT buzz.is_hex64(v) THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed snapshot');
  END IF;
  IF (ev->>'kind') IS DISTINCT FROM '30622' OR (ev->>'content') IS DISTINCT FROM '' THEN
    PERFORM buzz.reject('BZ400', 'invalid: a snapshot is kind 30622 with empty content');
  END IF;
  IF relay_pk = '' OR (ev->>'pubkey') IS DISTINCT FROM relay_pk THEN
    PERFORM buzz.reject('BZ400', 'invalid: a snapshot is signed by the relay key');
  END IF;
  IF EXISTS (SELECT 1 FROM jsonb_array_elements(e_tags) t
              WHERE jsonb_typeof(t) <> 'array' OR jsonb_array_length(t) < 2
                 OR EXISTS (SELECT 1 FROM jsonb_array_elements(t) x WHERE jsonb_typeof(x) <> 'string')
                 OR t->>0 NOT IN ('d', 'p', 'h')
                 OR (t->>0 = 'h' AND t->>1 !~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'))
     OR buzz.tag_values(e_tags, 'd') IS DISTINCT FROM ARRAY[v]
     OR buzz.tag_values(e_tags, 'p') IS DISTINCT FROM ARRAY[v] THEN
    PERFORM buzz.reject('BZ400', 'invalid: a snapshot has d = p = viewer and h = channel ids');
  END IF;
  e_created := (ev->>'created_at')::bigint;
  -- The protocol promise: at most `ahead` seconds ahead of the database clock. The caller waits
  -- for the clock and builds again, so this is a 'retry', not an error.
  IF e_created > buzz.now_unix() + ahead THEN
    RETURN 'retry';
  END IF;

  -- The subtransaction lets a 'retry' undo the fence UPDATE: the fence must take the row lock
  -- first (so the head we read next cannot change under us), yet a retry must leave nothing behind.
  BEGIN
    -- I3: the fence. Takes the viewer's state row lock; a concurrent publisher of any generation
    -- waits here, and the WHERE is re-checked on the row it committed (EvalPlanQual). One UPDATE
    -- records the whole publication (it is rolled back with the subtransaction on 'retry').
    UPDATE buzz.visibility_state s
       SET published_generation = g, published_created_at = e_created, published_event = e_id,
           published_at = now()
     WHERE s.viewer = v AND s.published_generation < g
       AND (s.published_created_at IS NULL OR s.published_created_at < e_created);
    IF NOT FOUND THEN
      SELECT s.published_generation INTO old_gen FROM buzz.visibility_state s WHERE s.viewer = v;
      IF old_gen IS NULL OR old_gen >= g THEN
        -- Stale. Clear an outbox row that is already covered so nobody claims it again; a row
        -- with a newer generation stays (EvalPlanQual re-checks generation on a bumped row).
        DELETE FROM buzz.visibility_outbox o WHERE o.viewer = v AND o.generation <= old_gen;
        RETURN 'stale';
      END IF;
      RETURN 'retry';  -- created_at not above the recorded head
    END IF;

    -- I4: strictly above every earlier snapshot of the viewer, whatever key signed it. Read after
    -- the lock (a new statement, a new snapshot): every head writer holds this same row lock.
    SELECT max(e.created_at) INTO head_created FROM buzz.events e WHERE e.kind = 30622 AND e.d_tag = v;
    IF e_created <= head_created THEN
      RAISE EXCEPTION USING ERRCODE = 'BZRTY', MESSAGE = 'snapshot created_at not above the head';
    END IF;

    -- Replace the head: every 30622 of this viewer, any author (key rotation), then the new one.
    DELETE FROM buzz.events e WHERE e.kind = 30622 AND e.d_tag = v;
    INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag, tagvals,
                             scope, scope_p)
    VALUES (e_id, relay_pk, e_created, 30622, e_tags, '', ev->>'sig', v, buzz.event_tagvals(e_tags),
            'p', v);
    -- Only if no newer generation arrived meanwhile (that row keeps its work and was re-notified).
    DELETE FROM buzz.visibility_outbox o WHERE o.viewer = v AND o.generation <= g;
    RETURN 'published';
  EXCEPTION WHEN SQLSTATE 'BZRTY' THEN
    RETURN 'retry';
  END;
END $$;
COMMENT ON FUNCTION buzz.publish_visibility_snapshot(text, bigint, jsonb) IS
  'NIP-DV fenced replace of viewer''s kind 30622 head with ev (built from visibility_source at generation, id and signature VERIFIED BY THE CALLER; execute granted to buzz_relay and buzz_operator only). Returns ''published'' (head replaced, published_generation = generation, outbox row cleared unless a newer generation arrived), ''stale'' (a generation >= this one is already published; a covered outbox row is cleared) or ''retry'' (created_at not above every earlier 30622 of the viewer by any key, or more than snapshot_max_ahead_seconds ahead of the database clock: re-read, wait for the clock, rebuild; nothing changed). Raises BZ400 for a malformed snapshot.';

CREATE OR REPLACE FUNCTION buzz.publish_visibility_snapshots(viewers text[], generations bigint[], evs jsonb[])
RETURNS TABLE (viewer text, outcome text)
LANGUAGE plpgsql AS $$
DECLARE
  n integer := coalesce(array_length(viewers, 1), 0);
BEGIN
  IF n <> coalesce(array_length(generations, 1), 0) OR n <> coalesce(array_length(evs, 1), 0) THEN
    PERFORM buzz.reject('BZ400', 'invalid: viewers, generations and events differ in length');
  END IF;
  FOR i IN 1 .. n LOOP
    viewer := viewers[i];
    PERFORM 1 FROM buzz.visibility_state s WHERE s.viewer = viewers[i] FOR UPDATE SKIP LOCKED;
    IF NOT FOUND AND EXISTS (SELECT 1 FROM buzz.visibility_state s WHERE s.viewer = viewers[i]) THEN
      outcome := 'busy';
    ELSE
      -- We hold the row (or there is none: 'stale'), so the fence UPDATE inside does not wait.
      outcome := buzz.publish_visibility_snapshot(viewers[i], generations[i], evs[i]);
    END IF;
    RETURN NEXT;
  END LOOP;
END $$;
COMMENT ON FUNCTION buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]) IS
  'Batch of publish_visibility_snapshot in one transaction (callers VERIFIED ids and signatures; execute granted to buzz_relay and buzz_operator only). Returns each viewer''s outcome: published, stale, retry, or busy (its state row was locked by another transaction; nothing changed; publish it alone). Never waits for a state row while holding another, so it cannot deadlock with multi-viewer writers.';

-- 0008 (its comment is 0003's)
CREATE OR REPLACE FUNCTION buzz.visibility_source(viewer text,
                                                  OUT generation bigint, OUT hidden uuid[], OUT created_at_floor bigint)
LANGUAGE plpgsql STABLE AS $$
BEGIN
  SELECT coalesce(s.target_generation, 0),
         coalesce((SELECT array_agg(m.channel_id ORDER BY m.channel_id) FROM buzz.members m
                    WHERE m.pubkey = $1 AND m.hidden_at IS NOT NULL), '{}'),
         -- Every author of the address counts (relay key rotation), and so does what we recorded
         -- as published (an operator may have deleted the head row; clients may still hold it).
         coalesce(greatest((SELECT max(e.created_at) FROM buzz.events e
                             WHERE e.kind = 30622 AND e.d_tag = $1),
                           s.published_created_at), 0)
    INTO generation, hidden, created_at_floor
    FROM (SELECT 1) one
    LEFT JOIN buzz.visibility_state s ON s.viewer = $1;
END $$;
COMMENT ON FUNCTION buzz.visibility_source(text) IS
  'NIP-DV source of one viewer''s snapshot, read in ONE snapshot: target generation, hidden DM channel ids (sorted), and created_at floor = newest created_at of any kind 30622 with d = viewer by any author (or the recorded published one). A snapshot built from it must use created_at > floor.';

-------------------------------------------------------------------------------------------------
-- 0002
CREATE OR REPLACE FUNCTION buzz.set_dm_hidden(viewer text, channel uuid, hide boolean) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE changed boolean;
BEGIN
  PERFORM buzz.lock_dm(channel);
  IF NOT EXISTS (SELECT 1 FROM buzz.members WHERE channel_id = channel AND pubkey = viewer) THEN
    PERFORM buzz.reject('BZ403', 'restricted: not a member of this channel');
  END IF;
  IF hide THEN
    UPDATE buzz.members SET hidden_at = now()
     WHERE channel_id = channel AND pubkey = viewer AND hidden_at IS NULL;
  ELSE
    UPDATE buzz.members SET hidden_at = NULL
     WHERE channel_id = channel AND pubkey = viewer AND hidden_at IS NOT NULL;
  END IF;
  GET DIAGNOSTICS changed = ROW_COUNT;
  RETURN changed;
END $$;
COMMENT ON FUNCTION buzz.set_dm_hidden(text, uuid, boolean) IS NULL;

COMMENT ON FUNCTION buzz.hide_dm(text, uuid) IS
  'Operator hide: hides DM channel for viewer (same effect as a kind 41012 from viewer). Returns true when the hidden set changed; the generation bump and outbox row follow through the members trigger. SQLSTATE BZ403 when the channel is unknown or viewer is not a member.';
COMMENT ON FUNCTION buzz.unhide_dm(text, uuid) IS
  'Operator re-open: makes DM channel visible again for viewer. Returns true when the hidden set changed. SQLSTATE BZ403 when the channel is unknown or viewer is not a member.';

-------------------------------------------------------------------------------------------------
-- 0008 (its comment is 0009's)
CREATE OR REPLACE FUNCTION buzz.claim_visibility_work(p_claim uuid, p_max integer, p_lease interval)
RETURNS TABLE (viewer text, generation bigint, attempts integer, pending_seconds double precision)
LANGUAGE plpgsql AS $$
BEGIN
  -- A claim lost in a crash is harmless (the row is simply claimable again), so its commit does
  -- not wait for the WAL flush: one fsync less on the path from a change to its snapshot.
  PERFORM set_config('synchronous_commit', 'off', true);
  RETURN QUERY
  WITH fresh AS (
    SELECT o.viewer FROM buzz.visibility_outbox o
     WHERE o.available_at <= now() AND o.attempts = 0
       AND (o.claim_id IS NULL OR o.lease_until < now())
     ORDER BY o.available_at
     LIMIT p_max
     FOR UPDATE SKIP LOCKED
  ), failing AS (
    SELECT o.viewer FROM buzz.visibility_outbox o
     WHERE o.available_at <= now() AND o.attempts > 0
       AND (o.claim_id IS NULL OR o.lease_until < now())
     ORDER BY o.available_at
     LIMIT greatest(1, p_max / 4)
     FOR UPDATE SKIP LOCKED
  )
  UPDATE buzz.visibility_outbox o SET claim_id = p_claim, lease_until = now() + p_lease
    FROM (SELECT f.viewer FROM fresh f UNION ALL SELECT b.viewer FROM failing b) c
   WHERE o.viewer = c.viewer
  RETURNING o.viewer, o.generation, o.attempts, extract(epoch FROM now() - o.enqueued_at)::double precision;
END $$;
COMMENT ON FUNCTION buzz.claim_visibility_work(uuid, integer, interval) IS
  'Claims up to p_max fresh available outbox rows plus up to greatest(1, p_max / 4) rows in backoff (so rows that keep failing never starve fresh work, nor fresh work them), FOR UPDATE SKIP LOCKED, expired leases re-taken, under claim id p_claim until now() + p_lease. Commit it on its own: no lock is held afterwards. Commits with synchronous_commit off (a claim lost in a crash only makes the row claimable again).';

-- 0003
CREATE OR REPLACE FUNCTION buzz.release_visibility_claim(p_viewer text, p_claim uuid, p_error text,
                                                         p_base interval, p_cap interval)
RETURNS boolean
LANGUAGE sql AS $$
  SELECT set_config('synchronous_commit', 'off', true);  -- lost in a crash: the lease expires instead
  WITH r AS (
    UPDATE buzz.visibility_outbox o
       SET claim_id = NULL, lease_until = NULL, attempts = o.attempts + 1, last_error = left(p_error, 500),
           available_at = now() + least(p_cap, p_base * power(2, least(o.attempts, 30)))
     WHERE o.viewer = p_viewer AND o.claim_id = p_claim
    RETURNING 1)
  SELECT EXISTS (SELECT 1 FROM r)
$$;
COMMENT ON FUNCTION buzz.release_visibility_claim(text, uuid, text, interval, interval) IS
  'Gives a claimed outbox row back after a failed publication: attempts + 1, last_error, available again after least(p_cap, p_base * 2^attempts). Only while claim id p_claim still holds; returns whether it did.';

-------------------------------------------------------------------------------------------------
-- 0004
CREATE OR REPLACE FUNCTION buzz.claim_due_reminders(p_max integer, p_lease interval, p_with_event boolean DEFAULT true)
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

CREATE OR REPLACE FUNCTION buzz.rollback_reminder_claims(p_ids text[], p_stamps bigint[])
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

-- 0006
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
    RAISE EXCEPTION 'confirm_reminder_claims: % ids but % stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0);
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
  'Pairs with a stale stamp emit nothing.';

-------------------------------------------------------------------------------------------------
-- 0011
CREATE OR REPLACE FUNCTION buzz.retire_generation(p_viewer text, p_generation bigint) RETURNS void
LANGUAGE sql AS $$
  INSERT INTO buzz.visibility_retired AS r (viewer, generation) VALUES (p_viewer, p_generation)
  ON CONFLICT (viewer) DO UPDATE SET generation = EXCLUDED.generation
   WHERE EXCLUDED.generation > r.generation
$$;
COMMENT ON FUNCTION buzz.retire_generation(text, bigint) IS
  'Records that p_viewer''s generations up to p_generation were used (keeping the maximum): a visibility_state row inserted for that viewer later starts above it.';

-------------------------------------------------------------------------------------------------
-- 0003
CREATE OR REPLACE FUNCTION buzz.visibility_lag_detail(lim integer DEFAULT 100)
RETURNS TABLE (viewer text, target_generation bigint, published_generation bigint,
               pending_seconds double precision, attempts integer, last_error text,
               retry_in_seconds double precision, claimed boolean, lease_left_seconds double precision)
LANGUAGE sql STABLE AS $$
  SELECT coalesce(s.viewer, o.viewer), s.target_generation, s.published_generation,
         extract(epoch FROM now() - coalesce(o.enqueued_at, s.changed_at))::double precision,
         o.attempts, o.last_error,
         greatest(0, extract(epoch FROM o.available_at - now()))::double precision,
         o.claim_id IS NOT NULL,
         extract(epoch FROM o.lease_until - now())::double precision
    FROM (SELECT * FROM buzz.visibility_state x WHERE x.target_generation > x.published_generation) s
    FULL JOIN buzz.visibility_outbox o ON o.viewer = s.viewer
   ORDER BY o.attempts DESC NULLS LAST, 4 DESC
   LIMIT lim
$$;
COMMENT ON FUNCTION buzz.visibility_lag_detail(integer) IS
  'NIP-DV operator detail: pending viewers and outbox rows, most failed attempts first, then oldest: generations, pending age, attempts, last error, seconds until the next attempt, claim and lease left.';

-- 0005
CREATE OR REPLACE FUNCTION buzz.instance_heartbeat(p_instance text, p_slot text, p_listen text DEFAULT NULL)
RETURNS void
LANGUAGE sql AS $$
  INSERT INTO buzz.instances AS i (instance_id, slot_name, listen_addr)
  VALUES (p_instance, p_slot, p_listen)
  ON CONFLICT (instance_id) DO UPDATE
     SET heartbeat_at = now(),
         slot_name    = EXCLUDED.slot_name,
         listen_addr  = coalesce(EXCLUDED.listen_addr, i.listen_addr);
$$;
COMMENT ON FUNCTION buzz.instance_heartbeat(text, text, text) IS
  'Registers a buzzpg serve process or refreshes its heartbeat. Called every few seconds by each process.';

CREATE OR REPLACE FUNCTION buzz.reap_instances(p_stale interval)
RETURNS TABLE (slot_name text, instance_id text, action text)
LANGUAGE plpgsql AS $$
DECLARE
  r record;
BEGIN
  FOR r IN
    SELECT s.slot_name::text AS slot, i.instance_id AS inst
      FROM pg_replication_slots s
      LEFT JOIN buzz.instances i ON i.slot_name = s.slot_name::text
     WHERE s.database = current_database()
       AND s.slot_type = 'logical'
       AND s.slot_name LIKE 'buzz\_%'
       AND NOT s.active
       AND (i.instance_id IS NULL OR i.heartbeat_at < now() - p_stale)
  LOOP
    BEGIN
      PERFORM pg_drop_replication_slot(r.slot);
      slot_name := r.slot; instance_id := r.inst; action := 'slot dropped';
      RETURN NEXT;
    EXCEPTION WHEN object_in_use OR undefined_object THEN
      NULL; -- became active again, or another reaper was faster
    END;
  END LOOP;
  FOR r IN
    DELETE FROM buzz.instances i
     WHERE i.heartbeat_at < now() - p_stale
       AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s WHERE s.slot_name::text = i.slot_name)
    RETURNING i.slot_name AS slot, i.instance_id AS inst
  LOOP
    slot_name := r.slot; instance_id := r.inst; action := 'instance removed';
    RETURN NEXT;
  END LOOP;
END $$;
COMMENT ON FUNCTION buzz.reap_instances(interval) IS
  'Drops inactive buzz_% replication slots (current database) of instances silent for longer than p_stale, '
  'then their instance rows. Run by every live buzzpg process on each heartbeat; operators may call it too. '
  'Needs the REPLICATION attribute (or superuser) to drop slots.';
