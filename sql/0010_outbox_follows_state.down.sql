ALTER TABLE buzz.visibility_outbox DROP CONSTRAINT IF EXISTS visibility_outbox_viewer_fkey;

-- publish_visibility_snapshot as 0003 defined it.
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
