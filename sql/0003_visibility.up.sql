-- NIP-DV: the per-viewer visibility snapshot (kind 30622) and the outbox that drives it.
--
-- The truth is buzz.visibility_state (target_generation > published_generation = a snapshot is
-- owed, kept in the partial index visibility_pending_idx). buzz.visibility_outbox is only the work
-- queue (claim, lease, backoff); sweeps re-create rows from the state, so a lost row cannot hide work.
--
-- Publishing is fenced by the database, not by a lock a process holds:
--   visibility_source            one consistent read: generation, hidden set, created_at floor
--   (Go builds and signs the 30622 event with the relay key)
--   publish_visibility_snapshot  lock the state row with the fence UPDATE first, then check
--                                created_at against every head of the address, then replace.
-- Lock order (0001): visibility_state row, then buzz.events 30622 rows of that viewer, then the
-- outbox row. Everything here runs under READ COMMITTED.

-------------------------------------------------------------------------------------------------
-- One statement = one snapshot: generation g is always paired with the hidden set of g (the
-- members trigger bumps the generation in the transaction that changes hidden_at). Two statements
-- under READ COMMITTED could pair g+1 with the set of g and publish a wrong state for good.
CREATE FUNCTION buzz.visibility_source(viewer text,
                                       OUT generation bigint, OUT hidden uuid[], OUT created_at_floor bigint)
LANGUAGE sql STABLE AS $$
  SELECT coalesce(s.target_generation, 0),
         coalesce((SELECT array_agg(m.channel_id ORDER BY m.channel_id) FROM buzz.members m
                    WHERE m.pubkey = $1 AND m.hidden_at IS NOT NULL), '{}'),
         -- Every author of the address counts (relay key rotation), and so does what we recorded
         -- as published (an operator may have deleted the head row; clients may still hold it).
         coalesce(greatest((SELECT max(e.created_at) FROM buzz.events e
                             WHERE e.kind = 30622 AND e.d_tag = $1),
                           s.published_created_at), 0)
    FROM (SELECT 1) one
    LEFT JOIN buzz.visibility_state s ON s.viewer = $1
$$;
COMMENT ON FUNCTION buzz.visibility_source(text) IS
  'NIP-DV source of one viewer''s snapshot, read in ONE snapshot: target generation, hidden DM channel ids (sorted), and created_at floor = newest created_at of any kind 30622 with d = viewer by any author (or the recorded published one). A snapshot built from it must use created_at > floor.';

-------------------------------------------------------------------------------------------------
-- The fenced replace. Outcomes:
--   'published'  the event is the viewer's head, published_generation = generation, and the outbox
--                row is gone unless a newer generation arrived meanwhile.
--   'stale'      a generation >= this one is already published; nothing published. An outbox row
--                already covered by the published generation is cleared, so nothing loops.
--   'retry'      created_at is not above every earlier snapshot of the viewer (any author), or is
--                more than snapshot_max_ahead_seconds ahead of the database clock: re-read the
--                source (and wait for the clock) and build again. Nothing changed.
-- Raises BZ400 for a malformed event (wrong kind, author other than the relay key, d/p not the
-- viewer, h not channel ids). The CALLER verifies id and signature (as for accept_event), hence the
-- grants at the end.
CREATE FUNCTION buzz.publish_visibility_snapshot(viewer text, generation bigint, ev jsonb)
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

-------------------------------------------------------------------------------------------------
-- Batch form for the listener: one transaction (one commit) for many viewers. Each viewer goes
-- through publish_visibility_snapshot with its own fence and its own 'retry' subtransaction. The
-- state row is taken with SKIP LOCKED first, so the batch NEVER WAITS for a state row while it
-- holds others: a multi-viewer writer in any order (a raw UPDATE of many members from psql) cannot
-- deadlock with it. A viewer whose row is busy comes back 'busy' (nothing changed): publish it
-- alone. Any error rolls back the whole batch.
CREATE FUNCTION buzz.publish_visibility_snapshots(viewers text[], generations bigint[], evs jsonb[])
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

-------------------------------------------------------------------------------------------------
-- Outbox claims: short committed transactions, no row lock held while signing.
--
-- Fresh rows (attempts = 0, which includes every row a new generation touched: bump_visibility
-- resets attempts) are claimed before rows that keep failing, and failing rows get at most a
-- quarter of a batch, so a poison viewer cannot starve fresh work and fresh work cannot starve a
-- recovering one. An expired lease (its owner died) is claimable by anyone.
CREATE FUNCTION buzz.claim_visibility_work(p_claim uuid, p_max integer, p_lease interval)
RETURNS TABLE (viewer text, generation bigint, attempts integer, pending_seconds double precision)
LANGUAGE sql AS $$
  -- A claim lost in a crash is harmless (the row is simply claimable again), so its commit does
  -- not wait for the WAL flush: one fsync less on the path from a change to its snapshot.
  SELECT set_config('synchronous_commit', 'off', true);
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
    FROM (SELECT viewer FROM fresh UNION ALL SELECT viewer FROM failing) c
   WHERE o.viewer = c.viewer
  RETURNING o.viewer, o.generation, o.attempts, extract(epoch FROM now() - o.enqueued_at)::double precision
$$;
COMMENT ON FUNCTION buzz.claim_visibility_work(uuid, integer, interval) IS
  'Claims up to p_max available outbox rows (FOR UPDATE SKIP LOCKED; fresh rows first, rows in backoff get at most a quarter of the batch; expired leases are re-taken) under claim id p_claim until now() + p_lease. Commit it on its own: no lock is held afterwards. Commits with synchronous_commit off (a claim lost in a crash only makes the row claimable again).';

-- Failed publication: give the row back with capped exponential backoff, only while our claim
-- still holds (a newer generation cleared the claim and reset backoff: leave that alone).
CREATE FUNCTION buzz.release_visibility_claim(p_viewer text, p_claim uuid, p_error text,
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

-- Graceful shutdown: give back unfinished claims at once (no backoff; the NOTIFY trigger wakes the
-- other listeners because the row becomes claim-free and available).
CREATE FUNCTION buzz.release_visibility_claims(p_claims uuid[])
RETURNS integer
LANGUAGE sql AS $$
  WITH r AS (
    UPDATE buzz.visibility_outbox o SET claim_id = NULL, lease_until = NULL
     WHERE o.claim_id = ANY (p_claims)
    RETURNING 1)
  SELECT count(*)::integer FROM r
$$;
COMMENT ON FUNCTION buzz.release_visibility_claims(uuid[]) IS
  'Releases every outbox row held under the given claim ids without backoff (graceful shutdown). Returns how many.';

-- The sweep's repair step: the state is the truth. Every pending viewer (partial index) gets an
-- outbox row; a row whose generation fell behind the target is raised. Returns how many rows it
-- created or raised. A row created for a viewer published meanwhile is harmless: its publication
-- comes back 'stale' and clears it.
CREATE FUNCTION buzz.sweep_visibility()
RETURNS integer
LANGUAGE sql AS $$
  WITH ins AS (
    INSERT INTO buzz.visibility_outbox AS o (viewer, generation)
    SELECT s.viewer, s.target_generation FROM buzz.visibility_state s
     WHERE s.target_generation > s.published_generation
       AND NOT EXISTS (SELECT 1 FROM buzz.visibility_outbox x
                        WHERE x.viewer = s.viewer AND x.generation >= s.target_generation)
    ORDER BY s.viewer
    ON CONFLICT (viewer) DO UPDATE SET generation = EXCLUDED.generation
     WHERE o.generation < EXCLUDED.generation
    RETURNING 1)
  SELECT count(*)::integer FROM ins
$$;
COMMENT ON FUNCTION buzz.sweep_visibility() IS
  'Repairs the work queue from the truth: creates (or raises) the outbox row of every viewer whose target generation is ahead of the published one. Listeners call it at start, after every LISTEN reconnect and periodically. Returns how many rows it created or raised.';

-------------------------------------------------------------------------------------------------
-- Operators: SELECT * FROM buzz.visibility_lag();  SELECT * FROM buzz.visibility_lag_detail();
CREATE FUNCTION buzz.visibility_lag(
  OUT pending_viewers bigint,          -- target > published
  OUT oldest_pending_seconds double precision,  -- since the oldest unpublished change
  OUT missing_outbox bigint,           -- pending without an outbox row (the next sweep repairs)
  OUT claimed bigint,                  -- rows under a live lease
  OUT expired_leases bigint,           -- claimed rows whose owner did not finish in time
  OUT in_backoff bigint,               -- rows waiting after failed publications
  OUT max_attempts integer,
  OUT worst_viewer text,               -- the viewer with the most failed attempts
  OUT worst_error text)
LANGUAGE sql STABLE AS $$
  SELECT
    (SELECT count(*) FROM buzz.visibility_state s WHERE s.target_generation > s.published_generation),
    (SELECT extract(epoch FROM now() - min(coalesce(o.enqueued_at, s.changed_at)))::double precision
       FROM buzz.visibility_state s LEFT JOIN buzz.visibility_outbox o ON o.viewer = s.viewer
      WHERE s.target_generation > s.published_generation),
    (SELECT count(*) FROM buzz.visibility_state s
      WHERE s.target_generation > s.published_generation
        AND NOT EXISTS (SELECT 1 FROM buzz.visibility_outbox o WHERE o.viewer = s.viewer)),
    (SELECT count(*) FROM buzz.visibility_outbox o WHERE o.claim_id IS NOT NULL AND o.lease_until >= now()),
    (SELECT count(*) FROM buzz.visibility_outbox o WHERE o.claim_id IS NOT NULL AND o.lease_until < now()),
    (SELECT count(*) FROM buzz.visibility_outbox o WHERE o.attempts > 0),
    (SELECT max(o.attempts) FROM buzz.visibility_outbox o),
    w.viewer, w.last_error
  FROM (SELECT 1) one
  LEFT JOIN LATERAL (SELECT o.viewer, o.last_error FROM buzz.visibility_outbox o
                      WHERE o.attempts > 0 ORDER BY o.attempts DESC, o.viewer LIMIT 1) w ON true
$$;
COMMENT ON FUNCTION buzz.visibility_lag() IS
  'NIP-DV operator summary, one row: pending viewers, age of the oldest pending change, pending viewers missing an outbox row, live claims, expired leases, rows in backoff, the worst attempts count with its viewer and last error. Per-viewer detail: buzz.visibility_lag_detail().';

CREATE FUNCTION buzz.visibility_lag_detail(lim integer DEFAULT 100)
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

-------------------------------------------------------------------------------------------------
-- The publisher trusts its caller with signatures, like accept_event.
REVOKE ALL ON FUNCTION buzz.publish_visibility_snapshot(text, bigint, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.claim_visibility_work(uuid, integer, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.release_visibility_claim(text, uuid, text, interval, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.release_visibility_claims(uuid[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.sweep_visibility() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION buzz.publish_visibility_snapshot(text, bigint, jsonb),
                          buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]),
                          buzz.claim_visibility_work(uuid, integer, interval),
                          buzz.release_visibility_claim(text, uuid, text, interval, interval),
                          buzz.release_visibility_claims(uuid[]),
                          buzz.sweep_visibility(),
                          buzz.visibility_source(text),
                          buzz.visibility_lag(), buzz.visibility_lag_detail(integer)
   TO buzz_relay, buzz_operator;
