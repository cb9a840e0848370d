-- buzz.accept_event and its helpers: the whole acceptance of one verified event, atomically.
--
-- Client errors RAISE with a buzz SQLSTATE, so the transaction is rolled back and the bad event
-- changes nothing; the message text already carries the NIP-01 OK prefix. The Go side maps:
--   BZ400 invalid:   BZ401 auth-required:   BZ403 restricted:   BZ409 blocked:
-- Verdicts that are not errors (accepted, duplicate, have newer, deleted) come back as a row.

CREATE FUNCTION buzz.reject(code text, msg text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION USING ERRCODE = code, MESSAGE = msg;
END $$;
COMMENT ON FUNCTION buzz.reject(text, text) IS
  'Raises a client error: code is a buzz SQLSTATE (BZ400 invalid, BZ401 auth-required, BZ403 restricted, BZ409 blocked), msg carries the OK prefix.';

CREATE FUNCTION buzz.cfg(k text) RETURNS text
LANGUAGE sql STABLE AS $$ SELECT value FROM buzz.config WHERE key = k $$;
COMMENT ON FUNCTION buzz.cfg(text) IS 'Value of a buzz.config setting (NULL when unset).';

CREATE FUNCTION buzz.kind_class(kind integer) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT CASE
    WHEN kind IN (0, 3) OR (kind >= 10000 AND kind < 20000) THEN 'replaceable'
    WHEN kind >= 20000 AND kind < 30000 THEN 'ephemeral'
    WHEN kind >= 30000 AND kind < 40000 THEN 'addressable'
    ELSE 'regular' END
$$;
COMMENT ON FUNCTION buzz.kind_class(integer) IS 'NIP-01 kind range: regular, replaceable, ephemeral or addressable.';

CREATE FUNCTION buzz.is_human_visible(kind integer) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT kind IN (9, 40002, 45001, 45003) $$;
COMMENT ON FUNCTION buzz.is_human_visible(integer) IS
  'Kinds that count as human-visible DM activity and resurface a DM for participants who hid it.';

CREATE FUNCTION buzz.tag_values(tags jsonb, name text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(t->>1 ORDER BY n), '{}') FROM jsonb_array_elements(tags) WITH ORDINALITY AS x(t, n)
  WHERE t->>0 = name AND jsonb_array_length(t) >= 2
$$;
COMMENT ON FUNCTION buzz.tag_values(jsonb, text) IS 'Values of every tag named name, in order.';

CREATE FUNCTION buzz.event_tagvals(tags jsonb) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(DISTINCT (t->>0) || ':' || (t->>1)), '{}') FROM jsonb_array_elements(tags) t
  WHERE length(t->>0) = 1 AND jsonb_array_length(t) >= 2
$$;
COMMENT ON FUNCTION buzz.event_tagvals(jsonb) IS
  'The ''x:value'' keys of every single-letter tag: what #x filters match (GIN-indexed as events.tagvals).';

CREATE FUNCTION buzz.is_hex64(s text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT s ~ '^[0-9a-f]{64}$' $$;

CREATE FUNCTION buzz.now_unix() RETURNS bigint
LANGUAGE sql STABLE AS $$ SELECT floor(extract(epoch FROM clock_timestamp()))::bigint $$;
COMMENT ON FUNCTION buzz.now_unix() IS 'The database clock in unix seconds (the clock every created_at check uses).';

-- participant_hash: SHA-256 of the sorted, de-duplicated 32-byte participant pubkeys.
CREATE FUNCTION buzz.participant_hash(participants text[]) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT sha256(string_agg(decode(p, 'hex'), ''::bytea ORDER BY p))
  FROM (SELECT DISTINCT unnest(participants) AS p) s
$$;
COMMENT ON FUNCTION buzz.participant_hash(text[]) IS
  'DM identity: sha256 of the sorted, de-duplicated 32-byte participant pubkeys.';

-------------------------------------------------------------------------------------------------
-- Visibility generation: every change of a member's hidden state bumps that viewer's target
-- generation and upserts their outbox row, in the transaction that made the change. A trigger on
-- buzz.members does it, so a raw UPDATE from psql converges exactly like the protocol commands.

CREATE FUNCTION buzz.bump_visibility(v text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE g bigint;
BEGIN
  -- Never read-then-write: the increment happens under the row lock the upsert takes.
  INSERT INTO buzz.visibility_state AS s (viewer, target_generation, changed_at)
  VALUES (v, 1, now())
  ON CONFLICT (viewer) DO UPDATE SET target_generation = s.target_generation + 1, changed_at = now()
  RETURNING target_generation INTO g;
  -- A new generation resets backoff and frees any claim: whoever publishes next publishes g
  -- (an older claimer is fenced by publish_visibility_snapshot).
  INSERT INTO buzz.visibility_outbox AS o (viewer, generation)
  VALUES (v, g)
  ON CONFLICT (viewer) DO UPDATE
    SET generation = EXCLUDED.generation, available_at = now(), attempts = 0, last_error = NULL,
        claim_id = NULL, lease_until = NULL;
  RETURN g;
END $$;
COMMENT ON FUNCTION buzz.bump_visibility(text) IS
  'Bumps a viewer''s target generation (target = target + 1) and upserts their outbox row with it. Called by the members trigger; returns the new generation.';

CREATE FUNCTION buzz.members_hidden_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' THEN
    PERFORM buzz.bump_visibility(OLD.pubkey);
  ELSE
    PERFORM buzz.bump_visibility(NEW.pubkey);
  END IF;
  RETURN NULL;
END $$;

CREATE TRIGGER members_hidden_update AFTER UPDATE OF hidden_at ON buzz.members
  FOR EACH ROW WHEN ((OLD.hidden_at IS NULL) IS DISTINCT FROM (NEW.hidden_at IS NULL))
  EXECUTE FUNCTION buzz.members_hidden_changed();
CREATE TRIGGER members_hidden_insert AFTER INSERT ON buzz.members
  FOR EACH ROW WHEN (NEW.hidden_at IS NOT NULL)
  EXECUTE FUNCTION buzz.members_hidden_changed();
CREATE TRIGGER members_hidden_delete AFTER DELETE ON buzz.members
  FOR EACH ROW WHEN (OLD.hidden_at IS NOT NULL)
  EXECUTE FUNCTION buzz.members_hidden_changed();

-- Wake listeners when outbox work appears. Constant payload (never the row); PostgreSQL folds
-- identical notifications of one transaction into one. Claims and backoff releases do not notify.
CREATE FUNCTION buzz.visibility_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('buzz_visibility', '');
  RETURN NULL;
END $$;
CREATE TRIGGER visibility_outbox_notify AFTER INSERT OR UPDATE ON buzz.visibility_outbox
  FOR EACH ROW WHEN (NEW.claim_id IS NULL AND NEW.available_at <= now())
  EXECUTE FUNCTION buzz.visibility_outbox_notify();

-------------------------------------------------------------------------------------------------
-- DM state changes. Lock order: channel row, then member rows ORDER BY pubkey, then (through the
-- trigger) visibility_state/outbox rows by viewer.

CREATE FUNCTION buzz.lock_dm(channel uuid) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM 1 FROM buzz.channels WHERE id = channel FOR SHARE;
  IF NOT FOUND THEN
    PERFORM buzz.reject('BZ403', 'restricted: unknown channel');
  END IF;
  -- Every member row, hidden or not: a hide that has not committed yet must commit after us
  -- (it waits here), and one that committed before us is seen by our next statement.
  PERFORM 1 FROM buzz.members WHERE channel_id = channel ORDER BY pubkey FOR UPDATE;
END $$;
COMMENT ON FUNCTION buzz.lock_dm(uuid) IS
  'Locks a DM in the documented order (channel, then members by pubkey) so hides and resurfacing follow commit order.';

CREATE FUNCTION buzz.set_dm_hidden(viewer text, channel uuid, hide boolean) RETURNS boolean
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

CREATE FUNCTION buzz.hide_dm(viewer text, channel uuid) RETURNS boolean
LANGUAGE sql AS $$ SELECT buzz.set_dm_hidden(viewer, channel, true) $$;
COMMENT ON FUNCTION buzz.hide_dm(text, uuid) IS
  'Operator hide: hides DM channel for viewer (same effect as a kind 41012 from viewer). Returns true when the hidden set changed; the generation bump and outbox row follow through the members trigger. SQLSTATE BZ403 when the channel is unknown or viewer is not a member.';

CREATE FUNCTION buzz.unhide_dm(viewer text, channel uuid) RETURNS boolean
LANGUAGE sql AS $$ SELECT buzz.set_dm_hidden(viewer, channel, false) $$;
COMMENT ON FUNCTION buzz.unhide_dm(text, uuid) IS
  'Operator re-open: makes DM channel visible again for viewer. Returns true when the hidden set changed. SQLSTATE BZ403 when the channel is unknown or viewer is not a member.';

-- Opens (or finds) the DM of exactly these participants. Idempotent under races: two opens of
-- one set meet on the participant_hash unique index and get one channel.
CREATE FUNCTION buzz.open_dm(opener text, participants text[], event_id text,
                             OUT channel_id uuid, OUT created boolean)
LANGUAGE plpgsql AS $$
DECLARE
  ps text[];
  h bytea;
BEGIN
  SELECT array_agg(DISTINCT p ORDER BY p) INTO ps FROM unnest(participants || opener) p;
  IF array_length(ps, 1) < 2 OR array_length(ps, 1) > 9 THEN
    PERFORM buzz.reject('BZ400', 'invalid: a DM has 2 to 9 participants');
  END IF;
  h := buzz.participant_hash(ps);
  INSERT INTO buzz.channels (participant_hash, created_by, created_event)
  VALUES (h, opener, event_id)
  ON CONFLICT (participant_hash) DO NOTHING
  RETURNING id INTO channel_id;
  created := channel_id IS NOT NULL;
  IF created THEN
    INSERT INTO buzz.members (channel_id, pubkey)
    SELECT open_dm.channel_id, p FROM unnest(ps) p ORDER BY p;
  ELSE
    SELECT c.id INTO channel_id FROM buzz.channels c WHERE c.participant_hash = h;
    -- Re-opening a DM the opener had hidden makes it visible again for the opener only.
    PERFORM buzz.set_dm_hidden(opener, channel_id, false);
  END IF;
END $$;
COMMENT ON FUNCTION buzz.open_dm(text, text[], text) IS
  'Creates the DM of opener + participants (2-9 distinct keys) or returns the existing one; re-opening un-hides it for the opener.';

-- Resurfacing: human-visible activity clears every other participant's hide, in the message's
-- transaction, after locking the DM so the outcome follows commit order.
CREATE FUNCTION buzz.resurface_dm(channel uuid, sender text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  m record;
  n integer := 0;
BEGIN
  PERFORM buzz.lock_dm(channel);
  FOR m IN SELECT pubkey FROM buzz.members
            WHERE channel_id = channel AND pubkey <> sender AND hidden_at IS NOT NULL
            ORDER BY pubkey
  LOOP
    UPDATE buzz.members SET hidden_at = NULL WHERE channel_id = channel AND pubkey = m.pubkey;
    n := n + 1;
  END LOOP;
  RETURN n;
END $$;
COMMENT ON FUNCTION buzz.resurface_dm(uuid, text) IS
  'Clears the hide of every DM participant except sender (under the DM lock, members in pubkey order); returns how many resurfaced.';

-------------------------------------------------------------------------------------------------
-- NIP-ER validation (PROTOCOL.md): returns not_before (NULL when absent).
CREATE FUNCTION buzz.validate_reminder(tags jsonb, expires bigint) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
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

-- Stores the reminder row of a new 30300 version; a newer version cancels older unconfirmed ones.
CREATE FUNCTION buzz.arm_reminder(p_id text, p_pubkey text, p_d text, p_created_at bigint,
                                  p_not_before bigint, p_expires bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE buzz.reminders r SET state = 'cancelled', cancelled_at = now(), lease_until = NULL
   WHERE r.pubkey = p_pubkey AND r.d_tag = p_d AND r.state IN ('armed', 'claimed');
  IF p_not_before IS NOT NULL THEN
    INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before, expires_at)
    VALUES (p_id, p_pubkey, p_d, p_created_at, p_not_before, p_expires);
    -- Wake schedulers only when this reminder is due before every other armed one: they sleep
    -- until the earliest, and NOTIFY serialises committing transactions, so it stays off the
    -- common path (payload: when this one is due).
    IF NOT EXISTS (SELECT 1 FROM buzz.reminders r
                    WHERE r.state = 'armed' AND r.not_before <= p_not_before AND r.id <> p_id
                      AND (r.expires_at IS NULL OR r.expires_at > buzz.now_unix())) THEN
      PERFORM pg_notify('buzz_reminders', p_not_before::text);
    END IF;
  END IF;
END $$;
COMMENT ON FUNCTION buzz.arm_reminder(text, text, text, bigint, bigint, bigint) IS
  'Arms the reminder row of a new 30300 version and cancels older unconfirmed versions of the same address.';

-------------------------------------------------------------------------------------------------
-- NIP-09: applies a stored kind 5 request of author.
CREATE FUNCTION buzz.apply_deletion(author text, del_id text, del_created_at bigint, p_tags jsonb)
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
    -- A tombstone even for ids not seen yet: the id stays deleted when published later.
    INSERT INTO buzz.deleted_ids (id, pubkey, deleted_by) VALUES (target, author, del_id)
    ON CONFLICT (id) DO NOTHING;
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

-------------------------------------------------------------------------------------------------
CREATE FUNCTION buzz.accept_event(ev jsonb, OUT ok boolean, OUT message text)
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
     OR e_sig !~ '^[0-9a-f]{128}$' OR jsonb_typeof(ev->'created_at') IS DISTINCT FROM 'number'
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
                    FILTER (WHERE length(t->>0) = 1 AND t->>1 IS NOT NULL), '{}')
    INTO bad_tags, exp_s, h_val, t_actor, t_p, t_d, e_tagvals
    FROM jsonb_array_elements(e_tags) WITH ORDINALITY AS x(t, n);
  IF bad_tags THEN
    PERFORM buzz.reject('BZ400', 'invalid: tags must be arrays of strings');
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
    IF sc = 'c'
       OR EXISTS (SELECT 1 FROM buzz.events x
                   WHERE x.id = ANY (buzz.tag_values(e_tags, 'e')) AND x.scope <> '*')
       OR EXISTS (SELECT 1 FROM unnest(buzz.tag_values(e_tags, 'a')) a
                   WHERE split_part(a, ':', 1) IN ('30300', '30622', '41010', '41011', '41012', '1059')) THEN
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

REVOKE ALL ON FUNCTION buzz.accept_event(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION buzz.accept_event(jsonb) TO buzz_relay, buzz_operator;
GRANT USAGE ON SCHEMA buzz TO buzz_relay, buzz_operator;
GRANT EXECUTE ON FUNCTION buzz.hide_dm(text, uuid), buzz.unhide_dm(text, uuid) TO buzz_operator, buzz_relay;
