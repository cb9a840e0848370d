-- Fixes from a review of acceptance and the visibility outbox.
--
-- 1. NIP-09 tombstones are kept per (id, deleter). With the id alone as the key, a kind 5 naming
--    someone else's id (accepted, and it deletes nothing) took the tombstone slot first; the
--    author's own deletion then deleted the row but left no tombstone of its own, and the id could
--    be published again. accept_event only honours the tombstone of the event's author.
-- 2. An event names at most one channel: only the first h tag was checked for membership, while
--    every h value went into tagvals, so a member of one DM could place a message in another DM's
--    #h history. Several h tags with the same value stay accepted.
-- 3. A deletion (kind 5) is public only when every event it names is stored and public: a request
--    naming a gated event that was already deleted, is not committed yet or is unknown was stored
--    public, revealing the gated event's id.
-- 4. The COMMENT of claim_visibility_work says what it does: rows in backoff come on top of p_max.
-- 5. A raw UPDATE that moves a hidden member row to another pubkey or channel changes the hidden
--    sets of the viewers involved; their generations now move too (only hidden_at changes did).
-- 6. Hex checks without bounded repetition: PostgreSQL's regex engine expands '{128}', so
--    '^[0-9a-f]{128}$' costs 17.1 us per call against 0.9 us for a length test plus '^[0-9a-f]+$'
--    ('{64}': 4.3 against 0.6 us). accept_event checks a signature and is_hex64 twice per event.
--    Both are NULL-safe now: a psql call without id, pubkey or sig got past the shape check (NULL
--    is not false) and failed later with a not-null violation instead of invalid:.

CREATE OR REPLACE FUNCTION buzz.is_hex64(s text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT coalesce(length(s) = 64 AND s ~ '^[0-9a-f]+$', false) $$;
COMMENT ON FUNCTION buzz.is_hex64(text) IS '64 lowercase hex characters (an event id or a pubkey); false for NULL.';

ALTER TABLE buzz.deleted_ids DROP CONSTRAINT deleted_ids_pkey;
ALTER TABLE buzz.deleted_ids ADD PRIMARY KEY (id, pubkey);

CREATE OR REPLACE FUNCTION buzz.apply_deletion(author text, del_id text, del_created_at bigint, p_tags jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  target text;
  addr text;
  parts text[];
  k integer;
BEGIN
  FOREACH target IN ARRAY buzz.tag_values(p_tags, 'e') LOOP
    CONTINUE WHEN NOT buzz.is_hex64(target);
    PERFORM pg_advisory_xact_lock(hashtextextended('event:' || target, 0));  -- see accept_event
    DELETE FROM buzz.events WHERE id = target AND pubkey = author AND kind <> 5;
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), lease_until = NULL
     WHERE id = target AND pubkey = author AND state IN ('armed', 'claimed');
    -- A tombstone even for ids not seen yet: the id stays deleted when published later. It is
    -- keyed by (id, deleter): a request naming someone else's id must not take the slot of the
    -- author's own tombstone (only the author's one is honoured by accept_event).
    INSERT INTO buzz.deleted_ids (id, pubkey, deleted_by) VALUES (target, author, del_id)
    ON CONFLICT (id, pubkey) DO NOTHING;
  END LOOP;
  FOREACH addr IN ARRAY buzz.tag_values(p_tags, 'a') LOOP
    parts := regexp_match(addr, '^([0-9]{1,5}):([0-9a-f]{64}):(.*)$');
    CONTINUE WHEN parts IS NULL OR parts[2] <> author;
    k := parts[1]::integer;
    CONTINUE WHEN buzz.kind_class(k) NOT IN ('replaceable', 'addressable');
    PERFORM pg_advisory_xact_lock(hashtextextended(k || ':' || author || ':' || parts[3], 0));
    DELETE FROM buzz.events
     WHERE kind = k AND pubkey = author AND created_at <= del_created_at
       AND (buzz.kind_class(k) = 'replaceable' OR d_tag = parts[3]);
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), lease_until = NULL
     WHERE k = 30300 AND pubkey = author AND d_tag = parts[3] AND created_at <= del_created_at
       AND state IN ('armed', 'claimed');
    INSERT INTO buzz.deleted_addresses AS da (kind, pubkey, d_tag, until_created_at)
    VALUES (k, author, CASE WHEN buzz.kind_class(k) = 'replaceable' THEN '' ELSE parts[3] END, del_created_at)
    ON CONFLICT (kind, pubkey, d_tag) DO UPDATE
      SET until_created_at = greatest(da.until_created_at, EXCLUDED.until_created_at);
  END LOOP;
END $$;
COMMENT ON FUNCTION buzz.apply_deletion(text, text, bigint, jsonb) IS
  'NIP-09: deletes the author''s own events named by e tags (leaving tombstones) and versions of a-tag addresses up to the request''s created_at; cancels affected reminders.';

CREATE OR REPLACE FUNCTION buzz.accept_event(ev jsonb, OUT ok boolean, OUT message text)
LANGUAGE plpgsql AS $$
DECLARE
  e_id text := ev->>'id';
  e_pubkey text := ev->>'pubkey';
  e_created bigint;
  e_kind integer;
  e_tags jsonb := ev->'tags';
  e_content text := ev->>'content';
  e_sig text := ev->>'sig';
  cls text;
  now_s bigint := buzz.now_unix();
  relay_pk text;
  max_future bigint;
  bad_tags boolean;
  t_actor text;
  t_p text;
  t_d text;
  e_tagvals text[];
  h_min text;
  h_max text;
  is_dup boolean;
  is_deleted boolean;
  exp_s text;
  e_expires bigint;
  h_val text;
  chan uuid;
  sender text;
  d text;
  sc "char" := '*';
  sp text;
  nb bigint;
  head record;
  inserted integer;
  dm record;
  ps text[];
BEGIN
  -- Shape. Go has checked id and signature; these guard psql callers and the columns.
  IF jsonb_typeof(ev) IS DISTINCT FROM 'object' OR NOT buzz.is_hex64(e_id) OR NOT buzz.is_hex64(e_pubkey)
     OR e_sig IS NULL OR length(e_sig) <> 128 OR e_sig !~ '^[0-9a-f]+$'
     OR jsonb_typeof(ev->'created_at') IS DISTINCT FROM 'number'
     OR jsonb_typeof(ev->'kind') IS DISTINCT FROM 'number' OR jsonb_typeof(e_tags) IS DISTINCT FROM 'array'
     OR jsonb_typeof(ev->'content') IS DISTINCT FROM 'string' THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed event');
  END IF;
  -- One pass over the tags for everything acceptance needs (each separate lookup is a query).
  -- ->> on a non-array element yields NULL, so the FILTERs are safe before the shape verdict.
  SELECT coalesce(bool_or(jsonb_typeof(t) <> 'array'
                          OR (jsonb_typeof(t) = 'array' AND jsonb_array_length(t) = 0)
                          OR (jsonb_typeof(t) = 'array' AND EXISTS (
                                SELECT 1 FROM jsonb_array_elements(t) v WHERE jsonb_typeof(v) <> 'string'))), false),
         (array_agg(t->>1 ORDER BY n) FILTER (WHERE t->>0 = 'expiration' AND t->>1 IS NOT NULL))[1],
         (array_agg(t->>1 ORDER BY n) FILTER (WHERE t->>0 = 'h' AND t->>1 IS NOT NULL))[1],
         (array_agg(t->>1 ORDER BY n) FILTER (WHERE t->>0 = 'actor' AND t->>1 IS NOT NULL))[1],
         (array_agg(t->>1 ORDER BY n) FILTER (WHERE t->>0 = 'p' AND t->>1 IS NOT NULL))[1],
         (array_agg(t->>1 ORDER BY n) FILTER (WHERE t->>0 = 'd' AND t->>1 IS NOT NULL))[1],
         coalesce(array_agg(DISTINCT (t->>0) || ':' || (t->>1))
                    FILTER (WHERE length(t->>0) = 1 AND t->>1 IS NOT NULL), '{}'),
         min(t->>1) FILTER (WHERE t->>0 = 'h'), max(t->>1) FILTER (WHERE t->>0 = 'h')
    INTO bad_tags, exp_s, h_val, t_actor, t_p, t_d, e_tagvals, h_min, h_max
    FROM jsonb_array_elements(e_tags) WITH ORDINALITY AS x(t, n);
  IF bad_tags THEN
    PERFORM buzz.reject('BZ400', 'invalid: tags must be arrays of strings');
  END IF;
  -- The membership check, the read gate and resurfacing all follow one channel; a second h value
  -- would put the event into another channel's history (#h) unchecked.
  IF h_min <> h_max THEN
    PERFORM buzz.reject('BZ400', 'invalid: an event names at most one channel (h tag)');
  END IF;
  SELECT coalesce(max(value) FILTER (WHERE key = 'relay_pubkey'), ''),
         coalesce(max(value) FILTER (WHERE key = 'max_future_seconds'), '900')::bigint
    INTO relay_pk, max_future FROM buzz.config;
  IF (ev->>'created_at')::numeric NOT BETWEEN 0 AND 9007199254740991
     OR (ev->>'kind')::numeric NOT BETWEEN 0 AND 65535 OR (ev->>'kind')::numeric % 1 <> 0
     OR (ev->>'created_at')::numeric % 1 <> 0 THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed event');
  END IF;
  e_created := (ev->>'created_at')::bigint;
  e_kind := (ev->>'kind')::integer;
  cls := buzz.kind_class(e_kind);

  IF e_kind = 22242 THEN
    PERFORM buzz.reject('BZ400', 'invalid: AUTH events are sent with AUTH, not EVENT');
  END IF;
  IF e_kind = 30622 THEN
    PERFORM buzz.reject('BZ403', 'restricted: relay-only kind');
  END IF;
  IF e_created > now_s + max_future THEN
    PERFORM buzz.reject('BZ400', 'invalid: created_at too far in future');
  END IF;

  -- NIP-40
  IF exp_s IS NOT NULL THEN
    IF exp_s !~ '^[0-9]{1,16}$' THEN
      PERFORM buzz.reject('BZ400', 'invalid: malformed expiration');
    END IF;
    e_expires := exp_s::bigint;
    IF e_expires <= now_s THEN
      PERFORM buzz.reject('BZ400', 'invalid: expired');
    END IF;
  END IF;

  -- Idempotent by id.
  -- Serialise with a concurrent NIP-09 deletion of this id (apply_deletion takes the same lock):
  -- its DELETE cannot see our uncommitted row, so without the lock both could commit and leave a
  -- deleted event stored.
  PERFORM pg_advisory_xact_lock(hashtextextended('event:' || e_id, 0));
  SELECT EXISTS (SELECT 1 FROM buzz.events WHERE id = e_id),
         EXISTS (SELECT 1 FROM buzz.deleted_ids WHERE id = e_id AND pubkey = e_pubkey)
    INTO is_dup, is_deleted;
  IF is_dup THEN
    ok := true; message := 'duplicate: already have this event'; RETURN;
  END IF;
  IF is_deleted THEN
    ok := false; message := 'blocked: deleted'; RETURN;
  END IF;

  -- Channels: an h tag must name an existing channel whose (effective) sender is a member.
  -- On events the relay key signs for someone else, the sender is the actor tag, else the first p.
  sender := e_pubkey;
  IF e_pubkey = relay_pk AND relay_pk <> '' THEN
    sender := coalesce(t_actor, t_p, e_pubkey);
  END IF;
  IF h_val IS NOT NULL THEN
    IF h_val !~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
      PERFORM buzz.reject('BZ403', 'restricted: unknown channel');
    END IF;
    chan := h_val::uuid;
    IF NOT EXISTS (SELECT 1 FROM buzz.channels WHERE id = chan) THEN
      PERFORM buzz.reject('BZ403', 'restricted: unknown channel');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM buzz.members WHERE channel_id = chan AND pubkey = sender) THEN
      PERFORM buzz.reject('BZ403', 'restricted: not a member of this channel');
    END IF;
    sc := 'c';
  END IF;

  -- Read scope (PROTOCOL.md "Read gates").
  IF e_kind IN (41010, 41011, 41012, 30300) THEN
    sc := 'a';
  ELSIF e_kind = 1059 THEN
    sp := t_p;
    IF sp IS NULL OR NOT buzz.is_hex64(sp) THEN
      PERFORM buzz.reject('BZ400', 'invalid: gift wrap needs a p tag');
    END IF;
    sc := 'p';
  ELSIF e_kind = 5 THEN
    -- A deletion is public only when every event it names is stored and public right now. A target
    -- that is gated, already deleted, not committed yet or unknown here may be a gated event, and
    -- a public request would reveal its id or address to everyone.
    IF sc = 'c'
       OR EXISTS (SELECT 1 FROM unnest(buzz.tag_values(e_tags, 'e')) AS t(id)
                   WHERE NOT EXISTS (SELECT 1 FROM buzz.events x WHERE x.id = t.id AND x.scope = '*'))
       OR EXISTS (SELECT 1 FROM unnest(buzz.tag_values(e_tags, 'a')) AS a(v)
                   CROSS JOIN LATERAL (SELECT regexp_match(a.v, '^([0-9]{1,5}):([0-9a-f]{64}):(.*)$') AS r) m
                   WHERE m.r IS NULL
                      OR m.r[1] IN ('30300', '30622', '41010', '41011', '41012', '1059')
                      OR NOT EXISTS (SELECT 1 FROM buzz.events x
                                      WHERE x.kind = m.r[1]::integer AND x.pubkey = m.r[2] AND x.scope = '*'
                                        AND (x.kind NOT BETWEEN 30000 AND 39999 OR x.d_tag = m.r[3]))) THEN
      sc := 'a';
    END IF;
  END IF;

  IF e_kind = 30300 THEN
    nb := buzz.validate_reminder(e_tags, e_expires);
  END IF;
  IF e_kind IN (41011, 41012) AND chan IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: missing h tag');
  END IF;
  IF e_kind IN (41010, 41011) THEN
    ps := buzz.tag_values(e_tags, 'p');
    IF EXISTS (SELECT 1 FROM unnest(ps) p WHERE NOT buzz.is_hex64(p)) THEN
      PERFORM buzz.reject('BZ400', 'invalid: p tags must be 64-char lowercase hex pubkeys');
    END IF;
    IF e_kind = 41010 AND (coalesce(array_length(ps, 1), 0) < 1 OR array_length(ps, 1) > 8) THEN
      PERFORM buzz.reject('BZ400', 'invalid: a DM open names 1 to 8 other participants');
    END IF;
    IF e_kind = 41011 AND coalesce(array_length(ps, 1), 0) < 1 THEN
      PERFORM buzz.reject('BZ400', 'invalid: name at least one member to add');
    END IF;
  END IF;

  -- Ephemeral: fanned out through a transactional logical message, never stored. Losing one in a
  -- crash is acceptable (it is ephemeral), so skip the WAL flush wait.
  IF cls = 'ephemeral' THEN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_logical_emit_message(true, 'buzz', jsonb_build_object(
      't', 'eph',
      'ev', jsonb_build_object('id', e_id, 'pubkey', e_pubkey, 'created_at', e_created, 'kind', e_kind,
                               'tags', e_tags, 'content', e_content, 'sig', e_sig),
      'scope', sc::text, 'scope_p', sp, 'channel_id', chan)::text);
    ok := true; message := ''; RETURN;
  END IF;

  -- Replaceable / addressable: serialise writers of the address, keep one head.
  IF cls IN ('replaceable', 'addressable') THEN
    d := CASE WHEN cls = 'addressable' THEN coalesce(t_d, '') ELSE '' END;
    PERFORM pg_advisory_xact_lock(hashtextextended(e_kind || ':' || e_pubkey || ':' || d, 0));
    IF EXISTS (SELECT 1 FROM buzz.deleted_addresses
                WHERE kind = e_kind AND pubkey = e_pubkey AND d_tag = d AND until_created_at >= e_created) THEN
      ok := false; message := 'blocked: deleted'; RETURN;
    END IF;
    SELECT id, created_at INTO head FROM buzz.events
     WHERE kind = e_kind AND pubkey = e_pubkey AND (cls = 'replaceable' OR d_tag = d)
     FOR UPDATE;
    IF FOUND THEN
      IF head.id = e_id THEN
        ok := true; message := 'duplicate: already have this event'; RETURN;
      END IF;
      -- Newer created_at wins; on a tie the lowest id.
      IF head.created_at > e_created OR (head.created_at = e_created AND head.id < e_id) THEN
        ok := false; message := 'duplicate: have newer'; RETURN;
      END IF;
      DELETE FROM buzz.events WHERE id = head.id;
    END IF;
  END IF;

  INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag, tagvals, h,
                           expires_at, scope, scope_p, channel_id)
  VALUES (e_id, e_pubkey, e_created, e_kind, e_tags, e_content, e_sig, d, e_tagvals,
          h_val, e_expires, sc, sp, chan)
  ON CONFLICT (id) DO NOTHING;
  GET DIAGNOSTICS inserted = ROW_COUNT;
  IF inserted = 0 THEN
    -- A concurrent writer stored the same id first; its effects are its own.
    ok := true; message := 'duplicate: already have this event'; RETURN;
  END IF;

  ok := true; message := '';
  CASE
    WHEN e_kind = 5 THEN
      PERFORM buzz.apply_deletion(e_pubkey, e_id, e_created, e_tags);
    WHEN e_kind = 41010 THEN
      dm := buzz.open_dm(e_pubkey, ps, e_id);
      message := 'response:' || jsonb_build_object('channel_id', dm.channel_id, 'created', dm.created)::text;
    WHEN e_kind = 41011 THEN
      SELECT array_agg(pubkey) INTO ps FROM (
        SELECT pubkey FROM buzz.members WHERE channel_id = chan
        UNION SELECT unnest(buzz.tag_values(e_tags, 'p'))) s;
      dm := buzz.open_dm(e_pubkey, ps, e_id);
      message := 'response:' || jsonb_build_object('channel_id', dm.channel_id, 'created', dm.created)::text;
    WHEN e_kind = 41012 THEN
      PERFORM buzz.set_dm_hidden(e_pubkey, chan, true);
    WHEN e_kind = 30300 THEN
      PERFORM buzz.arm_reminder(e_id, e_pubkey, d, e_created, nb, e_expires);
    WHEN chan IS NOT NULL AND buzz.is_human_visible(e_kind) THEN
      PERFORM buzz.resurface_dm(chan, sender);
    ELSE
      NULL;
  END CASE;
END $$;
COMMENT ON FUNCTION buzz.accept_event(jsonb) IS
  'The whole acceptance of one event whose id and signature the CALLER HAS VERIFIED (execute is granted to buzz_relay and buzz_operator only; operators post with `buzzpg send`, which signs). Stores with NIP-01 replacement, applies NIP-09/NIP-40, runs DM commands, resurfaces hidden DMs and bumps visibility generations, arms reminders, fans out ephemeral events, all in the caller''s transaction. Returns (ok, message) for accepted/duplicate/have-newer/deleted; raises BZ400/BZ401/BZ403 (message carries the OK prefix) for rejections.';

COMMENT ON FUNCTION buzz.claim_visibility_work(uuid, integer, interval) IS
  'Claims up to p_max fresh available outbox rows plus up to greatest(1, p_max / 4) rows in backoff (so rows that keep failing never starve fresh work, nor fresh work them), FOR UPDATE SKIP LOCKED, expired leases re-taken, under claim id p_claim until now() + p_lease. Commit it on its own: no lock is held afterwards. Commits with synchronous_commit off (a claim lost in a crash only makes the row claimable again).';

CREATE FUNCTION buzz.members_hidden_moved() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- Viewer state rows in viewer order (the documented lock order).
  PERFORM buzz.bump_visibility(v)
     FROM (SELECT DISTINCT v FROM unnest(ARRAY[OLD.pubkey, NEW.pubkey]) AS u(v)) x
    ORDER BY v;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_hidden_moved() IS
  'Trigger: a hidden member row moved to another pubkey or channel (raw UPDATE) bumps the generation of the old and the new viewer.';
CREATE TRIGGER members_hidden_moved AFTER UPDATE OF channel_id, pubkey ON buzz.members
  FOR EACH ROW WHEN ((OLD.hidden_at IS NOT NULL OR NEW.hidden_at IS NOT NULL)
                     AND (OLD.channel_id, OLD.pubkey) IS DISTINCT FROM (NEW.channel_id, NEW.pubkey))
  EXECUTE FUNCTION buzz.members_hidden_moved();
