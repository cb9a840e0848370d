-- 0027: a gift wrap (1059) carrying an h tag is refused (found in review).
--
-- PROTOCOL.md's read gates give an event with an h tag naming a DM to the DM's members, and a
-- gift wrap to the pubkey in its p tag. accept_event gave such a wrap scope 'p', so its recipient
-- read it without being a member of the channel it named, and a member who was not its recipient
-- did not; `{"kinds":[1059],"#h":[<dm>]}` from that recipient was closed 'restricted:' although a
-- readable row matched. Nothing confidential leaked (the sender chose the recipient), but the two
-- gates disagreed. A NIP-59 wrap names its recipient only, so the wrap with an h tag is refused,
-- with the relay's words (relay/event.go), before any lock; other kinds pay nothing more (the
-- check sits inside the kind 1059 branch). Wraps stored that way before stay stored, readable by
-- their recipient: `SELECT id FROM buzz.events WHERE kind = 1059 AND h IS NOT NULL` lists them.
--
-- accept_event: 0024's definition with the h check in the gift wrap branch.

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
  lock_ids text[];
  lock_id text;
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
  -- Served to the one pubkey its p tag names (the first one, below): a second recipient could
  -- never read it. The relay refuses it before calling here (relay/event.go, same words).
  IF e_kind = 1059 THEN
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(e_tags) t WHERE t->>0 = 'p' AND t->>1 <> t_p) THEN
      PERFORM buzz.reject('BZ400', 'invalid: a gift wrap names one recipient (p tag); send one wrap per recipient');
    END IF;
    -- Two read gates would claim it (members of the h channel, the p recipient): none is chosen.
    IF h_min IS NOT NULL THEN
      PERFORM buzz.reject('BZ400', 'invalid: a gift wrap names no channel (h tag); it is read by its recipient (p tag) only');
    END IF;
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
  -- Lock order, in every transaction: the event:<id> locks sorted by id, then address locks sorted
  -- by key (below, and in apply_deletion), then rows. A deletion takes its own id together with
  -- the well-formed ids it names, as one sorted set; apply_deletion takes them again, which is
  -- harmless (advisory locks are re-entrant).
  lock_ids := ARRAY[e_id];
  IF e_kind = 5 THEN
    lock_ids := ARRAY(SELECT DISTINCT i FROM unnest(ARRAY[e_id] || buzz.tag_values(e_tags, 'e')) i
                       WHERE buzz.is_hex64(i) ORDER BY i);
  END IF;
  FOREACH lock_id IN ARRAY lock_ids LOOP
    PERFORM pg_advisory_xact_lock(hashtextextended('event:' || lock_id, 0));
  END LOOP;
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
    -- open_dm adds the opener and drops repeats: count the distinct others it will see.
    IF e_kind = 41010
       AND (SELECT count(DISTINCT p) FROM unnest(ps) p WHERE p <> e_pubkey) NOT BETWEEN 1 AND 8 THEN
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
  'The whole acceptance of one event whose id and signature the CALLER HAS VERIFIED (execute is granted to buzz_relay and buzz_operator only; operators post with `buzzpg send`, which signs). Stores with NIP-01 replacement, applies NIP-09/NIP-40, runs DM commands, resurfaces hidden DMs and bumps visibility generations, arms reminders, fans out ephemeral events, all in the caller''s transaction. Lock order: event:<id> advisory locks sorted by id (a deletion takes its own id with the ids it names), then address locks sorted by key, then rows. Returns (ok, message) for accepted/duplicate/have-newer/deleted; raises BZ400/BZ401/BZ403 (message carries the OK prefix) for rejections, among them a gift wrap (1059) whose p tags name no recipient or two different ones, or that carries an h tag (the relay refuses both as well; from 0024 and 0027 on accept_event refuses them too, before any lock).';
