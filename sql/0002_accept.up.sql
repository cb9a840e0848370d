-- Acceptance: buzz.accept_event and buzz.accept_events store one verified event (or a batch)
-- atomically, with NIP-01 replacement, NIP-09 deletion, NIP-40 expiration, DM commands and gift
-- wrap checks. The helpers every later file uses come first.
--
-- Client errors RAISE with a buzz SQLSTATE, so the transaction is rolled back and the bad event
-- changes nothing; the message text already carries the NIP-01 OK prefix. The Go side maps:
--   BZ400 invalid:   BZ401 auth-required:   BZ403 restricted:   BZ409 blocked:
-- Verdicts that are not errors (accepted, duplicate, have newer, deleted) come back as a row.
--
-- Every function pins search_path (pg_catalog first, pg_temp last): a caller's search_path
-- cannot shadow a built-in function or operator.
--
-- Lock order, in every transaction: event:<id> advisory locks sorted by id, then address locks
-- sorted by key, then rows (the channel row, member rows by pubkey, visibility state rows by
-- viewer, outbox rows by viewer; events rows by id before reminder rows by id).

-------------------------------------------------------------------------------------------------
-- Helpers.

CREATE FUNCTION buzz.reject(code text, msg text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION USING ERRCODE = code, MESSAGE = msg;
END $$;
COMMENT ON FUNCTION buzz.reject(text, text) IS
  'Raises a client error: code is a buzz SQLSTATE (BZ400 invalid, BZ401 auth-required, BZ403 restricted, BZ409 blocked), msg carries the OK prefix.';

-- PL/pgSQL rather than SQL: a SQL function that cannot be inlined is planned again on every call;
-- PL/pgSQL keeps its plan for the session.
CREATE FUNCTION buzz.cfg(k text) RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN (SELECT c.value FROM buzz.config c WHERE c.key = k);
END $$;
COMMENT ON FUNCTION buzz.cfg(text) IS 'Value of a buzz.config setting (NULL when unset).';

-- The helpers below are PL/pgSQL, not SQL: a SQL function with SET is never inlined, and is
-- parsed and planned again in every transaction that calls it (docs/benchmarks.md).
CREATE FUNCTION buzz.kind_class(kind integer) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN CASE
    WHEN kind IN (0, 3) OR (kind >= 10000 AND kind < 20000) THEN 'replaceable'
    WHEN kind >= 20000 AND kind < 30000 THEN 'ephemeral'
    WHEN kind >= 30000 AND kind < 40000 THEN 'addressable'
    ELSE 'regular' END;
END $$;
COMMENT ON FUNCTION buzz.kind_class(integer) IS 'NIP-01 kind range: regular, replaceable, ephemeral or addressable.';

CREATE FUNCTION buzz.is_human_visible(kind integer) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN kind IN (9, 40002, 45001, 45003);
END $$;
COMMENT ON FUNCTION buzz.is_human_visible(integer) IS
  'Kinds that count as human-visible DM activity and resurface a DM for participants who hid it.';

CREATE FUNCTION buzz.tag_values(tags jsonb, name text) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN (SELECT coalesce(array_agg(x.t->>1 ORDER BY x.n), '{}') FROM jsonb_array_elements(tags) WITH ORDINALITY AS x(t, n)
           WHERE x.t->>0 = name AND jsonb_array_length(x.t) >= 2);
END $$;
COMMENT ON FUNCTION buzz.tag_values(jsonb, text) IS 'Values of every tag named name, in order.';

CREATE FUNCTION buzz.event_tagvals(tags jsonb) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN (SELECT coalesce(array_agg(DISTINCT (x.t->>0) || ':' || (x.t->>1)), '{}') FROM jsonb_array_elements(tags) AS x(t)
           WHERE length(x.t->>0) = 1 AND jsonb_array_length(x.t) >= 2);
END $$;
COMMENT ON FUNCTION buzz.event_tagvals(jsonb) IS
  'The ''x:value'' keys of every single-letter tag: what #x filters match (events.tagvals, indexed in buzz.event_tags).';

-- A length test plus '^[0-9a-f]+$': the regex engine expands a bounded repetition such as '{64}',
-- which costs several times more per call. NULL-safe: a NULL is not false, so a missing field
-- would pass a plain shape check.
CREATE FUNCTION buzz.is_hex64(s text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN coalesce(length(s) = 64 AND s ~ '^[0-9a-f]+$', false);
END $$;
COMMENT ON FUNCTION buzz.is_hex64(text) IS '64 lowercase hex characters (an event id or a pubkey); false for NULL.';

-- VOLATILE, as clock_timestamp() is. PL/pgSQL, as cfg: a SQL function with SET is never inlined
-- and parsed and planned again in every transaction that calls it (5 % of the backend's CPU for
-- an accept_events call of one event; docs/benchmarks.md).
CREATE FUNCTION buzz.now_unix() RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN floor(extract(epoch FROM clock_timestamp()))::bigint;
END $$;
COMMENT ON FUNCTION buzz.now_unix() IS 'The database clock in unix seconds (the clock every created_at check uses).';

CREATE FUNCTION buzz.participant_hash(participants text[]) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN (SELECT sha256(string_agg(decode(p, 'hex'), ''::bytea ORDER BY p))
            FROM (SELECT DISTINCT unnest(participants) AS p) s);
END $$;
COMMENT ON FUNCTION buzz.participant_hash(text[]) IS
  'DM identity: sha256 of the sorted, de-duplicated 32-byte participant pubkeys.';

-------------------------------------------------------------------------------------------------
-- DM commands. Lock order: channel row, then member rows ORDER BY pubkey, then (through the
-- members triggers) visibility_state and outbox rows by viewer.

CREATE FUNCTION buzz.lock_dm(channel uuid) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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

-- Opens (or finds) the DM of exactly these participants. Idempotent under races: two opens of
-- one set meet on the participant_hash unique index and get one channel.
CREATE FUNCTION buzz.open_dm(opener text, participants text[], event_id text,
                             OUT channel_id uuid, OUT created boolean)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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
-- NIP-09 deletion.

-- A deletion takes every lock it needs before it touches a row, in acceptance's order: the
-- event:<id> lock of each e target (sorted), then the address lock of each a target (sorted by
-- key), then rows. Accepting X holds event:X and then waits for X's address; a deletion that took
-- the address first would deadlock with it.
CREATE FUNCTION buzz.deletion_addresses(author text, p_tags jsonb)
RETURNS TABLE (kind integer, d_tag text, lock_key text) LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  RETURN QUERY
  SELECT DISTINCT s.k, s.d, s.k || ':' || author || ':' || s.d
    FROM (SELECT m[1]::integer AS k,
                 CASE WHEN buzz.kind_class(m[1]::integer) = 'replaceable' THEN '' ELSE m[3] END AS d
            FROM unnest(buzz.tag_values(p_tags, 'a')) a,
                 LATERAL regexp_match(a, '^([0-9]{1,5}):([0-9a-f]{64}):(.*)$') m
           WHERE m IS NOT NULL AND m[2] = author
             AND buzz.kind_class(m[1]::integer) IN ('replaceable', 'addressable')) s
   ORDER BY 3;
END $$;
COMMENT ON FUNCTION buzz.deletion_addresses(text, jsonb) IS
  'The author''s replaceable and addressable addresses a NIP-09 request names in a tags, sorted by the advisory lock key accept_event takes for each (kind:pubkey:d, with no d for a replaceable kind).';

-- Row locks: the events rows it deletes, then the reminder rows it cancels, each set by id and
-- locked before any row is written. The scheduler's batch confirm and rollback lock reminder rows
-- by id too; interleaving events and reminders per target, in address then id order, deadlocked
-- with them.
CREATE FUNCTION buzz.apply_deletion(author text, del_id text, del_created_at bigint, p_tags jsonb)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  ids text[] := ARRAY(SELECT DISTINCT t FROM unnest(buzz.tag_values(p_tags, 'e')) t
                       WHERE buzz.is_hex64(t) ORDER BY t);
  a record;
  target text;
BEGIN
  FOREACH target IN ARRAY ids LOOP
    PERFORM pg_advisory_xact_lock(pg_catalog.hashtextextended('event:' || target, 0::bigint));  -- see accept_event
  END LOOP;
  FOR a IN SELECT * FROM buzz.deletion_addresses(author, p_tags) LOOP
    PERFORM pg_advisory_xact_lock(pg_catalog.hashtextextended(a.lock_key, 0::bigint));          -- see accept_event
  END LOOP;

  -- Row locks in the one order: the events rows the deletes below remove, by id, then the
  -- reminder rows the cancels below change, by id. Each set is exactly what the statements
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
  'NIP-09: deletes the author''s own versions of a-tag addresses up to the request''s created_at and events named by e tags (leaving tombstones); cancels affected reminders. Takes every lock first: the advisory locks in acceptance''s order (ids, then addresses, each sorted and taken once; accept_event has already taken the ids with the request''s own), then the row locks in the one row order (the events rows it deletes, then the reminder rows it cancels, each by id); then touches rows.';

-------------------------------------------------------------------------------------------------
-- Gift wraps.

-- A gift wrap (1059) names its recipient only. With an h tag the read gates would disagree: the
-- channel's members and the recipient would both have a claim to read it. The relay refuses it
-- first (relay/event.go, same words). A trigger rather than a check in accept_event: it holds for
-- every writer, and its WHEN clause runs in the executor, so other rows run no PL/pgSQL.
CREATE FUNCTION buzz.events_gift_wrap_channel_guard() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  PERFORM buzz.reject('BZ400', 'invalid: a gift wrap names no channel (h tag); it is read by its recipient (p tag) only');
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.events_gift_wrap_channel_guard() IS
  'Trigger (BEFORE INSERT on events, for kind 1059 with an h tag): refuses the row with BZ400 (invalid:): members of the channel and the recipient would both have a claim to read it.';

CREATE TRIGGER events_gift_wrap_channel_guard BEFORE INSERT ON buzz.events
  FOR EACH ROW WHEN (NEW.kind = 1059 AND NEW.h IS NOT NULL)
  EXECUTE FUNCTION buzz.events_gift_wrap_channel_guard();

-------------------------------------------------------------------------------------------------
-- The #x filter index (buzz.event_tags). Triggers rather than a step in each writer: the
-- per-event insert, the set-based run insert, the snapshot publisher, NIP-09, replacement and the
-- upkeep purge all keep it, and so does psql. Their WHEN clauses run in the executor, so an
-- untagged event runs no PL/pgSQL. Events are not updated by buzzpg; an UPDATE that changes the
-- keys, created_at or id (psql) moves the rows all the same.
CREATE FUNCTION buzz.events_tags_sync() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF TG_OP <> 'INSERT' THEN
    -- Exactly the event's rows, each found through event_tags_idx.
    DELETE FROM buzz.event_tags t
     WHERE t.tagval = ANY (OLD.tagvals) AND t.created_at = OLD.created_at AND t.event_id = OLD.id;
  END IF;
  IF TG_OP <> 'DELETE' THEN
    INSERT INTO buzz.event_tags (tagval, created_at, event_id)
    SELECT DISTINCT v, NEW.created_at, NEW.id FROM unnest(NEW.tagvals) v WHERE v IS NOT NULL;
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.events_tags_sync() IS
  'Trigger (per row on events: AFTER INSERT and AFTER DELETE of a row with tag keys, AFTER UPDATE that changes tagvals, created_at or id): keeps buzz.event_tags, the index #x filters walk, equal to the events'' tagvals.';

CREATE FUNCTION buzz.events_tags_truncate() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  TRUNCATE buzz.event_tags;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.events_tags_truncate() IS
  'Trigger (AFTER TRUNCATE on events, which fires no row triggers): empties buzz.event_tags with it, so an event stored again finds no stale key in its way.';

CREATE TRIGGER events_tags_insert AFTER INSERT ON buzz.events
  FOR EACH ROW WHEN (NEW.tagvals <> '{}')
  EXECUTE FUNCTION buzz.events_tags_sync();
CREATE TRIGGER events_tags_update AFTER UPDATE OF id, created_at, tagvals ON buzz.events
  FOR EACH ROW WHEN (OLD.tagvals IS DISTINCT FROM NEW.tagvals OR OLD.created_at IS DISTINCT FROM NEW.created_at
                     OR OLD.id IS DISTINCT FROM NEW.id)
  EXECUTE FUNCTION buzz.events_tags_sync();
CREATE TRIGGER events_tags_delete AFTER DELETE ON buzz.events
  FOR EACH ROW WHEN (OLD.tagvals <> '{}')
  EXECUTE FUNCTION buzz.events_tags_sync();
CREATE TRIGGER events_tags_truncate AFTER TRUNCATE ON buzz.events
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.events_tags_truncate();

REVOKE ALL ON FUNCTION buzz.events_tags_sync(), buzz.events_tags_truncate() FROM PUBLIC;

-------------------------------------------------------------------------------------------------
-- Acceptance. accept_event runs the checks every event passes (shape, tags, kind, time), takes
-- the event locks, answers duplicates and deleted ids, checks the channel, then hands the event
-- to the function of its kind. That function does the rest, in this order: read scope and its
-- own checks, storage, then its effects. The row to store travels as a buzz.events value.

-- One pass over the tags for everything acceptance needs (each separate lookup is a query).
-- ->> on a non-array element yields NULL, so the FILTERs are safe before the shape verdict.
CREATE FUNCTION buzz.event_tag_summary(tags jsonb, OUT bad boolean, OUT expiration text, OUT h text,
                                       OUT actor text, OUT p text, OUT d text, OUT tagvals text[],
                                       OUT h_min text, OUT h_max text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
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
    INTO bad, expiration, h, actor, p, d, tagvals, h_min, h_max
    FROM jsonb_array_elements(tags) WITH ORDINALITY AS x(t, n);
END $$;
COMMENT ON FUNCTION buzz.event_tag_summary(jsonb) IS
  'One pass over an event''s tags: whether any tag is not a non-empty array of strings, the first expiration, h, actor, p and d values, the #x filter keys (tagvals), and the lowest and highest h value.';

-- The checks every event passes before any lock, in this order. Go has checked id and
-- signature; these guard psql callers and the columns.
CREATE FUNCTION buzz.check_event(ev jsonb, OUT e buzz.events, OUT actor text, OUT p text, OUT d text,
                                 OUT relay_pk text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  now_s bigint := buzz.now_unix();
  s record;
  max_future bigint;
BEGIN
  e.id := ev->>'id'; e.pubkey := ev->>'pubkey'; e.sig := ev->>'sig';
  e.tags := ev->'tags'; e.content := ev->>'content';
  IF jsonb_typeof(ev) IS DISTINCT FROM 'object' OR NOT buzz.is_hex64(e.id) OR NOT buzz.is_hex64(e.pubkey)
     OR e.sig IS NULL OR length(e.sig) <> 128 OR e.sig !~ '^[0-9a-f]+$'
     OR jsonb_typeof(ev->'created_at') IS DISTINCT FROM 'number'
     OR jsonb_typeof(ev->'kind') IS DISTINCT FROM 'number' OR jsonb_typeof(e.tags) IS DISTINCT FROM 'array'
     OR jsonb_typeof(ev->'content') IS DISTINCT FROM 'string' THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed event');
  END IF;
  SELECT * INTO s FROM buzz.event_tag_summary(e.tags);
  IF s.bad THEN
    PERFORM buzz.reject('BZ400', 'invalid: tags must be arrays of strings');
  END IF;
  -- The membership check, the read gate and resurfacing all follow one channel; a second h value
  -- would put the event into another channel's history (#h) unchecked.
  IF s.h_min <> s.h_max THEN
    PERFORM buzz.reject('BZ400', 'invalid: an event names at most one channel (h tag)');
  END IF;
  SELECT coalesce(max(c.value) FILTER (WHERE c.key = 'relay_pubkey'), ''),
         coalesce(max(c.value) FILTER (WHERE c.key = 'max_future_seconds'), '900')::bigint
    INTO relay_pk, max_future FROM buzz.config c;
  IF (ev->>'created_at')::numeric NOT BETWEEN 0 AND 9007199254740991
     OR (ev->>'kind')::numeric NOT BETWEEN 0 AND 65535 OR (ev->>'kind')::numeric % 1 <> 0
     OR (ev->>'created_at')::numeric % 1 <> 0 THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed event');
  END IF;
  e.created_at := (ev->>'created_at')::bigint;
  e.kind := (ev->>'kind')::integer;
  PERFORM buzz.check_kind(e.kind, e.tags, s.p);
  IF e.created_at > now_s + max_future THEN
    PERFORM buzz.reject('BZ400', 'invalid: created_at too far in future');
  END IF;
  -- NIP-40
  IF s.expiration IS NOT NULL THEN
    IF s.expiration !~ '^[0-9]{1,16}$' THEN
      PERFORM buzz.reject('BZ400', 'invalid: malformed expiration');
    END IF;
    e.expires_at := s.expiration::bigint;
    IF e.expires_at <= now_s THEN
      PERFORM buzz.reject('BZ400', 'invalid: expired');
    END IF;
  END IF;
  e.tagvals := s.tagvals; e.h := s.h; e.scope := '*';
  actor := s.actor; p := s.p; d := s.d;
END $$;
COMMENT ON FUNCTION buzz.check_event(jsonb) IS
  'The checks of accept_event that come before any lock: shape, tags, one channel, created_at and kind ranges, kinds refused here, created_at not too far ahead, NIP-40 expiration. Returns the row to store (scope *, no channel yet) and the first actor, p and d tag values and the relay pubkey; raises BZ400/BZ403 otherwise.';

-- Kinds refused before any lock.
CREATE FUNCTION buzz.check_kind(kind integer, tags jsonb, first_p text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF kind = 22242 THEN
    PERFORM buzz.reject('BZ400', 'invalid: AUTH events are sent with AUTH, not EVENT');
  END IF;
  IF kind = 30622 THEN
    PERFORM buzz.reject('BZ403', 'restricted: relay-only kind');
  END IF;
  -- A gift wrap is served to the one pubkey its p tag names (the first one): a second recipient
  -- could never read it. The relay refuses it before calling here (relay/event.go, same words).
  -- Other kinds pay one integer comparison.
  IF kind = 1059 THEN
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(tags) t WHERE t->>0 = 'p' AND t->>1 <> first_p) THEN
      PERFORM buzz.reject('BZ400', 'invalid: a gift wrap names one recipient (p tag); send one wrap per recipient');
    END IF;
  END IF;
END $$;
COMMENT ON FUNCTION buzz.check_kind(integer, jsonb, text) IS
  'Refuses AUTH events (22242) and the relay-only kind 30622, and a gift wrap (1059) whose p tags name two different recipients (first_p is its first p value).';

-- Idempotent by id. Serialise with a concurrent NIP-09 deletion of this id (apply_deletion takes
-- the same lock): its DELETE cannot see our uncommitted row, so without the lock both could
-- commit and leave a deleted event stored. A deletion takes its own id together with the
-- well-formed ids it names, as one sorted set; apply_deletion takes them again, which is harmless
-- (advisory locks are re-entrant).
CREATE FUNCTION buzz.lock_event_ids(p_id text, p_kind integer, p_tags jsonb) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  ids text[] := ARRAY[p_id];
  i text;
BEGIN
  IF p_kind = 5 THEN
    ids := ARRAY(SELECT DISTINCT x FROM unnest(ARRAY[p_id] || buzz.tag_values(p_tags, 'e')) x
                  WHERE buzz.is_hex64(x) ORDER BY x);
  END IF;
  FOREACH i IN ARRAY ids LOOP
    PERFORM pg_advisory_xact_lock(pg_catalog.hashtextextended('event:' || i, 0::bigint));
  END LOOP;
END $$;
COMMENT ON FUNCTION buzz.lock_event_ids(text, integer, jsonb) IS
  'Takes the event:<id> advisory locks of an event being accepted, sorted by id: its own id, and for a deletion (kind 5) also every well-formed id its e tags name.';

-- An h tag must name an existing channel whose (effective) sender is a member.
CREATE FUNCTION buzz.check_channel(p_h text, p_sender text) RETURNS uuid
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  chan uuid;
BEGIN
  IF p_h !~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
    PERFORM buzz.reject('BZ403', 'restricted: unknown channel');
  END IF;
  chan := p_h::uuid;
  IF NOT EXISTS (SELECT 1 FROM buzz.channels c WHERE c.id = chan) THEN
    PERFORM buzz.reject('BZ403', 'restricted: unknown channel');
  END IF;
  IF NOT EXISTS (SELECT 1 FROM buzz.members m WHERE m.channel_id = chan AND m.pubkey = p_sender) THEN
    PERFORM buzz.reject('BZ403', 'restricted: not a member of this channel');
  END IF;
  RETURN chan;
END $$;
COMMENT ON FUNCTION buzz.check_channel(text, text) IS
  'The channel an h tag value names; raises BZ403 (restricted:) when it is not a known channel or p_sender is not a member.';

-- Stores e. A concurrent writer may have stored the same id first: its effects are its own.
CREATE FUNCTION buzz.accept_plain(e buzz.events, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  inserted integer;
BEGIN
  INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag, tagvals, h,
                           expires_at, scope, scope_p, channel_id)
  VALUES (e.id, e.pubkey, e.created_at, e.kind, e.tags, e.content, e.sig, e.d_tag, e.tagvals,
          e.h, e.expires_at, e.scope, e.scope_p, e.channel_id)
  ON CONFLICT (id) DO NOTHING;
  GET DIAGNOSTICS inserted = ROW_COUNT;
  ok := true;
  message := CASE WHEN inserted = 0 THEN 'duplicate: already have this event' ELSE '' END;
END $$;
COMMENT ON FUNCTION buzz.accept_plain(buzz.events) IS
  'Stores an accepted event row: (true, '''') when stored, (true, duplicate) when a concurrent writer stored the same id first. Every kind''s acceptance stores through it.';

-- Human-visible activity in a DM clears every other participant's hide.
CREATE FUNCTION buzz.accept_dm_message(e buzz.events, sender text, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  SELECT a.ok, a.message INTO ok, message FROM buzz.accept_plain(e) a;
  IF message = '' THEN
    PERFORM buzz.resurface_dm(e.channel_id, sender);
  END IF;
END $$;
COMMENT ON FUNCTION buzz.accept_dm_message(buzz.events, text) IS
  'Stores a human-visible event of a DM and resurfaces the DM for every participant but sender who hid it.';

-- Fanned out through a transactional logical message, never stored. Losing one in a crash is
-- acceptable (it is ephemeral), so the commit skips the WAL flush wait.
CREATE FUNCTION buzz.accept_ephemeral(e buzz.events, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);
  PERFORM pg_logical_emit_message(true, 'buzz', jsonb_build_object(
    't', 'eph',
    'ev', jsonb_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                             'tags', e.tags, 'content', e.content, 'sig', e.sig),
    'scope', e.scope::text, 'scope_p', e.scope_p, 'channel_id', e.channel_id)::text);
  ok := true; message := '';
END $$;
COMMENT ON FUNCTION buzz.accept_ephemeral(buzz.events) IS
  'Fans out an ephemeral event (kinds 20000-29999) as a transactional logical message (prefix buzz, t eph) with its read scope; never stored. Turns synchronous_commit off for the transaction.';

-- Writers of one address are serialised by an advisory lock, and one head is kept: newer
-- created_at wins; on a tie the lowest id. The unique head indexes are the backstop.
CREATE FUNCTION buzz.replace_head(e buzz.events, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  head record;
  replaceable boolean := buzz.kind_class(e.kind) = 'replaceable';
BEGIN
  PERFORM pg_advisory_xact_lock(pg_catalog.hashtextextended(e.kind::text || ':' || e.pubkey || ':' || e.d_tag, 0::bigint));
  IF EXISTS (SELECT 1 FROM buzz.deleted_addresses x
              WHERE x.kind = e.kind AND x.pubkey = e.pubkey AND x.d_tag = e.d_tag
                AND x.until_created_at >= e.created_at) THEN
    ok := false; message := 'blocked: deleted'; RETURN;
  END IF;
  SELECT x.id, x.created_at INTO head FROM buzz.events x
   WHERE x.kind = e.kind AND x.pubkey = e.pubkey AND (replaceable OR x.d_tag = e.d_tag)
   FOR UPDATE;
  IF FOUND THEN
    IF head.id = e.id THEN
      ok := true; message := 'duplicate: already have this event'; RETURN;
    END IF;
    IF head.created_at > e.created_at OR (head.created_at = e.created_at AND head.id < e.id) THEN
      ok := false; message := 'duplicate: have newer'; RETURN;
    END IF;
    DELETE FROM buzz.events x WHERE x.id = head.id;
  END IF;
END $$;
COMMENT ON FUNCTION buzz.replace_head(buzz.events) IS
  'For a replaceable or addressable event (e.d_tag set, '''' for replaceable kinds): takes the address lock, then removes the head it replaces. Returns a verdict when e must not be stored (deleted address, same event, a newer head), ok NULL when it may.';

CREATE FUNCTION buzz.accept_replaceable(e buzz.events, d text, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  e.d_tag := CASE WHEN buzz.kind_class(e.kind) = 'addressable' THEN coalesce(d, '') ELSE '' END;
  SELECT r.ok, r.message INTO ok, message FROM buzz.replace_head(e) r;
  IF ok IS NULL THEN
    SELECT a.ok, a.message INTO ok, message FROM buzz.accept_plain(e) a;
  END IF;
END $$;
COMMENT ON FUNCTION buzz.accept_replaceable(buzz.events, text) IS
  'Accepts a replaceable or addressable event (d: its first d tag value): NIP-01 replacement of the address''s head, then storage.';

-- A deletion is public only when every event it names is stored and public right now. A target
-- that is gated, already deleted, not committed yet or unknown here may be a gated event, and a
-- public request would reveal its id or address to everyone.
CREATE FUNCTION buzz.accept_deletion(e buzz.events, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF e.scope = 'c'
     OR EXISTS (SELECT 1 FROM unnest(buzz.tag_values(e.tags, 'e')) AS t(id)
                 WHERE NOT EXISTS (SELECT 1 FROM buzz.events x WHERE x.id = t.id AND x.scope = '*'))
     OR EXISTS (SELECT 1 FROM unnest(buzz.tag_values(e.tags, 'a')) AS a(v)
                 CROSS JOIN LATERAL (SELECT regexp_match(a.v, '^([0-9]{1,5}):([0-9a-f]{64}):(.*)$') AS r) m
                 WHERE m.r IS NULL
                    OR m.r[1] IN ('30300', '30622', '41010', '41011', '41012', '1059')
                    OR NOT EXISTS (SELECT 1 FROM buzz.events x
                                    WHERE x.kind = m.r[1]::integer AND x.pubkey = m.r[2] AND x.scope = '*'
                                      AND (x.kind NOT BETWEEN 30000 AND 39999 OR x.d_tag = m.r[3]))) THEN
    e.scope := 'a';
  END IF;
  SELECT a.ok, a.message INTO ok, message FROM buzz.accept_plain(e) a;
  IF message = '' THEN
    PERFORM buzz.apply_deletion(e.pubkey, e.id, e.created_at, e.tags);
  END IF;
END $$;
COMMENT ON FUNCTION buzz.accept_deletion(buzz.events) IS
  'Accepts a NIP-09 deletion (kind 5): public only when every event it names is stored and public, author-only otherwise; stores it, then applies it (apply_deletion).';

-- The read gate serves a gift wrap to the one pubkey in its p tag (the first; check_kind refused
-- a second recipient).
CREATE FUNCTION buzz.accept_gift_wrap(e buzz.events, p text, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  e.scope_p := p;
  IF p IS NULL OR NOT buzz.is_hex64(p) THEN
    PERFORM buzz.reject('BZ400', 'invalid: gift wrap needs a p tag');
  END IF;
  e.scope := 'p';
  SELECT a.ok, a.message INTO ok, message FROM buzz.accept_plain(e) a;
END $$;
COMMENT ON FUNCTION buzz.accept_gift_wrap(buzz.events, text) IS
  'Accepts a gift wrap (1059) readable by its recipient only (p: its first p tag value, which must be a pubkey). One with an h tag is refused by the events trigger events_gift_wrap_channel_guard.';

CREATE FUNCTION buzz.accept_reminder(e buzz.events, d text, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  nb bigint;
BEGIN
  e.scope := 'a';
  nb := buzz.validate_reminder(e.tags, e.expires_at);
  e.d_tag := coalesce(d, '');
  SELECT r.ok, r.message INTO ok, message FROM buzz.replace_head(e) r;
  IF ok IS NOT NULL THEN
    RETURN;
  END IF;
  SELECT a.ok, a.message INTO ok, message FROM buzz.accept_plain(e) a;
  IF message = '' THEN
    PERFORM buzz.arm_reminder(e.id, e.pubkey, e.d_tag, e.created_at, nb, e.expires_at);
  END IF;
END $$;
COMMENT ON FUNCTION buzz.accept_reminder(buzz.events, text) IS
  'Accepts a NIP-ER reminder (30300, addressable, author-only): validates it, replaces the address''s head, stores it and arms its reminder row.';

-- DM commands: 41010 opens a DM, 41011 adds members (a new DM of the larger set), 41012 hides
-- one for its author. Author-only.
CREATE FUNCTION buzz.accept_dm_command(e buzz.events, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  ps text[];
  dm record;
BEGIN
  e.scope := 'a';
  IF e.kind IN (41011, 41012) AND e.channel_id IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: missing h tag');
  END IF;
  IF e.kind IN (41010, 41011) THEN
    ps := buzz.tag_values(e.tags, 'p');
    IF EXISTS (SELECT 1 FROM unnest(ps) x WHERE NOT buzz.is_hex64(x)) THEN
      PERFORM buzz.reject('BZ400', 'invalid: p tags must be 64-char lowercase hex pubkeys');
    END IF;
    -- open_dm adds the opener and drops repeats: count the distinct others it will see.
    IF e.kind = 41010
       AND (SELECT count(DISTINCT x) FROM unnest(ps) x WHERE x <> e.pubkey) NOT BETWEEN 1 AND 8 THEN
      PERFORM buzz.reject('BZ400', 'invalid: a DM open names 1 to 8 other participants');
    END IF;
    IF e.kind = 41011 AND coalesce(array_length(ps, 1), 0) < 1 THEN
      PERFORM buzz.reject('BZ400', 'invalid: name at least one member to add');
    END IF;
  END IF;
  SELECT a.ok, a.message INTO ok, message FROM buzz.accept_plain(e) a;
  IF message <> '' THEN
    RETURN;
  END IF;
  IF e.kind = 41012 THEN
    PERFORM buzz.set_dm_hidden(e.pubkey, e.channel_id, true);
    RETURN;
  END IF;
  IF e.kind = 41011 THEN
    SELECT array_agg(s.pubkey) INTO ps FROM (
      SELECT m.pubkey FROM buzz.members m WHERE m.channel_id = e.channel_id
      UNION SELECT unnest(buzz.tag_values(e.tags, 'p'))) s;
  END IF;
  dm := buzz.open_dm(e.pubkey, ps, e.id);
  message := 'response:' || jsonb_build_object('channel_id', dm.channel_id, 'created', dm.created)::text;
END $$;
COMMENT ON FUNCTION buzz.accept_dm_command(buzz.events) IS
  'Accepts a DM command (41010 open, 41011 add members, 41012 hide) and runs it; an open or add answers response:{"channel_id":..,"created":..}.';

CREATE FUNCTION buzz.accept_event(ev jsonb, OUT ok boolean, OUT message text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  c record;
  e buzz.events;
  sender text;
  is_dup boolean;
  is_deleted boolean;
  cls text;
BEGIN
  SELECT * INTO c FROM buzz.check_event(ev);
  e := c.e;
  cls := buzz.kind_class(e.kind);
  -- Lock order, in every transaction: the event:<id> locks sorted by id, then address locks
  -- sorted by key (replace_head, apply_deletion), then rows.
  PERFORM buzz.lock_event_ids(e.id, e.kind, e.tags);
  SELECT EXISTS (SELECT 1 FROM buzz.events x WHERE x.id = e.id),
         EXISTS (SELECT 1 FROM buzz.deleted_ids x WHERE x.id = e.id AND x.pubkey = e.pubkey)
    INTO is_dup, is_deleted;
  IF is_dup THEN
    ok := true; message := 'duplicate: already have this event'; RETURN;
  END IF;
  IF is_deleted THEN
    ok := false; message := 'blocked: deleted'; RETURN;
  END IF;
  -- On events the relay key signs for someone else, the sender is the actor tag, else the first p.
  sender := e.pubkey;
  IF e.pubkey = c.relay_pk AND c.relay_pk <> '' THEN
    sender := coalesce(c.actor, c.p, e.pubkey);
  END IF;
  IF e.h IS NOT NULL THEN
    e.channel_id := buzz.check_channel(e.h, sender);
    e.scope := 'c';
  END IF;
  -- Read scope per kind: docs/protocol.md, Read gates.
  CASE
    WHEN e.kind = 5 THEN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_deletion(e) a;
    WHEN e.kind IN (41010, 41011, 41012) THEN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_dm_command(e) a;
    WHEN e.kind = 30300 THEN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_reminder(e, c.d) a;
    WHEN e.kind = 1059 THEN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_gift_wrap(e, c.p) a;
    WHEN cls = 'ephemeral' THEN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_ephemeral(e) a;
    WHEN cls IN ('replaceable', 'addressable') THEN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_replaceable(e, c.d) a;
    WHEN e.channel_id IS NOT NULL AND buzz.is_human_visible(e.kind) THEN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_dm_message(e, sender) a;
    ELSE
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_plain(e) a;
  END CASE;
END $$;
COMMENT ON FUNCTION buzz.accept_event(jsonb) IS
  'The whole acceptance of one event whose id and signature the CALLER HAS VERIFIED (execute is granted to buzz_relay and buzz_operator only; operators post with `buzzpg send`, which signs). Stores with NIP-01 replacement, applies NIP-09/NIP-40, runs DM commands, resurfaces hidden DMs and bumps visibility generations, arms reminders, fans out ephemeral events, all in the caller''s transaction. Lock order: event:<id> advisory locks sorted by id (a deletion takes its own id with the ids it names), then address locks sorted by key, then rows. Returns (ok, message) for accepted/duplicate/have-newer/deleted; raises BZ400/BZ401/BZ403 (message carries the OK prefix) for rejections, among them a gift wrap (1059) whose p tags name no recipient or two different ones (the relay refuses the second as well; accept_event refuses it before any lock).';

-- The set-based path of accept_events. Most events of a busy relay are plain: no h tag, a regular
-- kind without effects (not 5, 1059, 41010-41012), well formed, not expired. accept_event would
-- only lock, look up and insert each; a run of them is stored by two statements instead of one
-- accept_event call each. plain_events says which events qualify; it is conservative: an event it
-- refuses takes accept_event, which gives it its verdict, whatever it is.
-- CASE, not AND, orders the tests: a cast or jsonb_array_length must not meet a value of the
-- wrong type (a raised error would abort the whole call).
CREATE FUNCTION buzz.plain_events(evs jsonb) RETURNS boolean[]
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  now_s bigint := buzz.now_unix();
  max_future bigint := coalesce(buzz.cfg('max_future_seconds'), '900')::bigint;
BEGIN
  RETURN ARRAY(
    SELECT CASE
      WHEN jsonb_typeof(e) IS DISTINCT FROM 'object'
        OR jsonb_typeof(e->'id') IS DISTINCT FROM 'string' OR jsonb_typeof(e->'pubkey') IS DISTINCT FROM 'string'
        OR jsonb_typeof(e->'sig') IS DISTINCT FROM 'string'
        OR jsonb_typeof(e->'created_at') IS DISTINCT FROM 'number'
        OR jsonb_typeof(e->'kind') IS DISTINCT FROM 'number' OR jsonb_typeof(e->'tags') IS DISTINCT FROM 'array'
        OR jsonb_typeof(e->'content') IS DISTINCT FROM 'string' THEN false
      -- One regex over the three (its cost is per character, plus a fixed cost per call).
      WHEN length(e->>'id') <> 64 OR length(e->>'pubkey') <> 64 OR length(e->>'sig') <> 128
        OR (e->>'id') || (e->>'pubkey') || (e->>'sig') !~ '^[0-9a-f]+$' THEN false
      WHEN (e->'created_at')::numeric NOT BETWEEN 0 AND now_s + max_future OR (e->'created_at')::numeric % 1 <> 0
        OR (e->'kind')::numeric NOT BETWEEN 0 AND 65535 OR (e->'kind')::numeric % 1 <> 0 THEN false
      WHEN (e->'kind')::integer IN (0, 3, 5, 1059, 41010, 41011, 41012)
        OR (e->'kind')::integer BETWEEN 10000 AND 39999 THEN false
      WHEN e->'tags' = '[]' THEN true  -- most events: no tag to look at
      ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_array_elements(e->'tags') t
         WHERE CASE WHEN jsonb_typeof(t) <> 'array' THEN true
                    WHEN jsonb_array_length(t) = 0 THEN true
                    WHEN EXISTS (SELECT 1 FROM jsonb_array_elements(t) v WHERE jsonb_typeof(v) <> 'string') THEN true
                    ELSE t->>0 = 'h' END)
        AND coalesce((SELECT x.t->>1 ~ '^[0-9]{1,16}$' AND (x.t->>1)::bigint > now_s
                        FROM jsonb_array_elements(e->'tags') WITH ORDINALITY AS x(t, n)
                       WHERE x.t->>0 = 'expiration' AND x.t->>1 IS NOT NULL
                       ORDER BY x.n LIMIT 1), true)
      END
    FROM jsonb_array_elements(evs) WITH ORDINALITY AS a(e, i) ORDER BY i);
END $$;
COMMENT ON FUNCTION buzz.plain_events(jsonb) IS
  'For each event of an accept_events array: whether it takes the set-based path (accept_plain_run): well formed, no h tag, a regular kind other than 5, 1059 and 41010-41012, created_at not too far ahead, not expired. false means accept_event decides.';

-- Stores events lo..hi of evs (1-based), all plain (plain_events), as accept_event would one by
-- one in their order: the event:<id> locks, sorted by id, in one statement; then, with a snapshot
-- taken after them, the look-ups of stored ids and the author's tombstones and the insert in one
-- statement. Of several storable events with one id the first is stored, the later ones are
-- duplicates, as they would be one after another. In a subtransaction: a run refused with a
-- client SQLSTATE (a value too long to index) is rolled back whole and returns NULLs, and
-- accept_events runs its events one by one, so each gets its own verdict.
-- A plain INSERT, not ON CONFLICT DO NOTHING: the locks and the look-up have settled duplicates,
-- and a speculative insertion costs a second probe of events_pkey and a WAL record per row (5 %
-- of the backend's CPU; docs/benchmarks.md). Only a writer that takes no event:<id> lock (psql)
-- can still store one of these ids meanwhile; the primary key then refuses the run (23505) and
-- accept_event, event by event, answers it as a duplicate.
-- enable_seqscan off: the look-ups are index probes at any size. A plan made while statistics
-- said buzz.events was tiny (a fresh relay) would otherwise scan the table for every event of
-- every call until the next ANALYZE replans it.
CREATE FUNCTION buzz.accept_plain_run(evs jsonb, lo integer, hi integer, OUT oks boolean[], OUT msgs text[])
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
SET enable_seqscan = off
AS $$
BEGIN
  PERFORM pg_advisory_xact_lock(pg_catalog.hashtextextended('event:' || s.id, 0::bigint))  -- see accept_event
     FROM (SELECT DISTINCT a.e->>'id' AS id FROM jsonb_array_elements(evs) WITH ORDINALITY AS a(e, n)
            WHERE a.n BETWEEN lo AND hi ORDER BY 1) s;
  WITH looked_up AS MATERIALIZED (  -- each look-up once per event
    SELECT a.n, x.*,
           EXISTS (SELECT 1 FROM buzz.events s WHERE s.id = x.id) AS stored,
           EXISTS (SELECT 1 FROM buzz.deleted_ids d WHERE d.id = x.id AND d.pubkey = x.pubkey) AS deleted
      FROM jsonb_array_elements(evs) WITH ORDINALITY AS a(e, n),
           LATERAL (SELECT a.e->>'id' AS id, a.e->>'pubkey' AS pubkey, (a.e->>'created_at')::bigint AS created_at,
                           (a.e->>'kind')::integer AS kind, a.e->'tags' AS tags, a.e->>'content' AS content,
                           a.e->>'sig' AS sig) x
     WHERE a.n BETWEEN lo AND hi),
  input AS MATERIALIZED (
    SELECT y.*, NOT y.stored AND NOT y.deleted
                AND y.n = min(y.n) FILTER (WHERE NOT y.deleted) OVER (PARTITION BY y.id) AS first
      FROM looked_up y),
  ins AS (
    INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, tagvals, expires_at, scope)
    SELECT x.id, x.pubkey, x.created_at, x.kind, x.tags, x.content, x.sig,
           CASE WHEN x.tags = '[]' THEN '{}' ELSE  -- most events: no tag to look at
             coalesce((SELECT array_agg(DISTINCT (t->>0) || ':' || (t->>1)) FROM jsonb_array_elements(x.tags) t
                        WHERE length(t->>0) = 1 AND t->>1 IS NOT NULL), '{}') END,
           CASE WHEN x.tags <> '[]' THEN
             (SELECT (y.t->>1)::bigint FROM jsonb_array_elements(x.tags) WITH ORDINALITY AS y(t, m)
               WHERE y.t->>0 = 'expiration' AND y.t->>1 IS NOT NULL ORDER BY y.m LIMIT 1) END,
           '*'
      FROM input x WHERE x.first
     ORDER BY x.n)  -- the batch's order, which fan-out (WAL order) keeps
  SELECT array_agg(NOT (x.deleted AND NOT x.stored) ORDER BY x.n),
         array_agg(CASE WHEN x.first THEN ''
                        WHEN x.deleted AND NOT x.stored THEN 'blocked: deleted'
                        ELSE 'duplicate: already have this event' END ORDER BY x.n)
    INTO oks, msgs
    FROM input x;
EXCEPTION
  WHEN SQLSTATE 'BZ400' OR SQLSTATE 'BZ401' OR SQLSTATE 'BZ403' OR SQLSTATE 'BZ409'
    OR SQLSTATE 'BZ429' OR SQLSTATE '22P05' OR SQLSTATE '22P02' OR SQLSTATE '22003'
    OR SQLSTATE '54000' OR SQLSTATE '23505' THEN
    oks := NULL; msgs := NULL;
END $$;
COMMENT ON FUNCTION buzz.accept_plain_run(jsonb, integer, integer) IS
  'Stores the plain events lo..hi of an accept_events array (plain_events) with accept_event''s verdicts, in one subtransaction: one statement takes their event:<id> locks sorted by id, one looks up stored ids and the authors'' tombstones and inserts. Returns each event''s ok and message, in order; NULLs when the run was refused with a client SQLSTATE, or with 23505 (a writer that takes no event:<id> lock stored one of its ids meanwhile), and rolled back.';

-- Group commit: most of an accepted event's cost is the transaction around it (round trip,
-- commit, WAL flush, a walsender wake-up), so the relay sends the events that arrive together as
-- one call (internal/store/batch.go). Each run of consecutive plain events (plain_events) is
-- stored set-based (accept_plain_run) in one subtransaction; every other event runs accept_event
-- in its own. Only consecutive ones: an event with effects (a deletion) must see the plain events
-- before it stored and its effects must reach the plain events after it. One refused with a
-- client SQLSTATE rolls back alone and its row says why (a run refused so goes again event by
-- event); any other error aborts the call, and the relay then stores each event on its own.
-- At most 60 events: PostgreSQL caches 64 subtransaction ids per backend, and a transaction past
-- that makes every other backend's snapshots look up pg_subtrans.
-- accept_event turns synchronous_commit off for an ephemeral event. That outlives the
-- subtransaction, so it is put back when the call holds any other event: an OK for a stored event
-- must not precede its WAL flush.
CREATE FUNCTION buzz.accept_events(evs jsonb, lock_wait_ms integer DEFAULT 0)
RETURNS TABLE (ok boolean, message text, code text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  ev jsonb;
  sync_commit text := current_setting('synchronous_commit');
  old_lock_timeout text := current_setting('lock_timeout');
  durable boolean := false;
  plain boolean[];
  n integer;
  i integer := 1;
  j integer;
  oks boolean[];
  msgs text[];
BEGIN
  IF evs IS NULL OR jsonb_typeof(evs) <> 'array' THEN
    PERFORM buzz.reject('BZ400', 'invalid: accept_events takes a JSON array of events');
  END IF;
  n := jsonb_array_length(evs);
  IF n > 120 THEN
    PERFORM buzz.reject('BZ400', 'invalid: at most 120 events per accept_events call');
  END IF;
  IF lock_wait_ms IS NULL OR lock_wait_ms < 0 THEN
    PERFORM buzz.reject('BZ400', 'invalid: lock_wait_ms must be 0 (wait as the session does) or a positive number of milliseconds');
  END IF;
  IF lock_wait_ms > 0 THEN
    PERFORM set_config('lock_timeout', lock_wait_ms::text, true);
  END IF;
  BEGIN
    plain := buzz.plain_events(evs);
  EXCEPTION WHEN OTHERS THEN
    plain := array_fill(false, ARRAY[n]);  -- a configuration it cannot read: accept_event says why
  END;
  -- One subtransaction per event stored alone and per run of plain events. PostgreSQL caches 64
  -- per backend; past them every snapshot taken meanwhile, anywhere, gets slower.
  IF (SELECT count(*) FROM unnest(plain) WITH ORDINALITY u(p, k) WHERE NOT p OR k = 1 OR NOT plain[k - 1]) > 60 THEN
    PERFORM buzz.reject('BZ400', 'invalid: more than 60 subtransactions in one accept_events call (one per event not stored set-based, one per run of those that are)');
  END IF;
  WHILE i <= n LOOP
    ev := evs -> (i - 1);
    -- A kind that is not a number is refused by accept_event; count it as durable to be safe.
    durable := durable OR NOT coalesce(jsonb_typeof(ev -> 'kind') = 'number'
                                       AND (ev ->> 'kind')::numeric >= 20000
                                       AND (ev ->> 'kind')::numeric < 30000, false);
    IF plain[i] THEN
      j := i;
      WHILE j < n AND plain[j + 1] LOOP
        j := j + 1;
      END LOOP;
      SELECT r.oks, r.msgs INTO oks, msgs FROM buzz.accept_plain_run(evs, i, j) r;
      IF oks IS NULL THEN  -- rolled back whole: event by event
        FOR k IN i .. j LOOP
          plain[k] := false;
        END LOOP;
        CONTINUE;
      END IF;
      FOR k IN 1 .. j - i + 1 LOOP
        ok := oks[k]; message := msgs[k]; code := NULL;
        RETURN NEXT;
      END LOOP;
      i := j + 1;
      CONTINUE;
    END IF;
    BEGIN
      SELECT a.ok, a.message INTO ok, message FROM buzz.accept_event(ev) a;
      code := NULL;
    EXCEPTION
      WHEN SQLSTATE 'BZ400' OR SQLSTATE 'BZ401' OR SQLSTATE 'BZ403' OR SQLSTATE 'BZ409'
        OR SQLSTATE 'BZ429' OR SQLSTATE '22P05' OR SQLSTATE '22P02' OR SQLSTATE '22003'
        OR SQLSTATE '54000' THEN
        GET STACKED DIAGNOSTICS code = RETURNED_SQLSTATE, message = MESSAGE_TEXT;
        ok := false;
    END;
    RETURN NEXT;
    i := i + 1;
  END LOOP;
  IF durable THEN
    PERFORM set_config('synchronous_commit', sync_commit, true);
  END IF;
  PERFORM set_config('lock_timeout', old_lock_timeout, true);
END $$;
COMMENT ON FUNCTION buzz.accept_events(jsonb, integer) IS
  'Accepts up to 120 events (a JSON array) in one transaction, each run of consecutive plain events set-based (accept_plain_run) and every other event as buzz.accept_event, each in its own subtransaction, at most 60 subtransactions; one row per event, in order: (ok, message) as accept_event returns them, or ok false with the client SQLSTATE (code) and message it raised (BZ400 invalid:, BZ401 auth-required:, BZ403 restricted:, BZ409 blocked:, BZ429 rate-limited:, 22P02/22P05/22003 invalid:, 54000 a value too long to index). Any other error aborts the whole call. lock_wait_ms > 0 bounds every lock wait in the call (lock_timeout, 55P03). Callers must have verified each signature, as for accept_event.';

-- These trust their caller to have verified signatures, and some store rows directly.
REVOKE ALL ON FUNCTION buzz.accept_event(jsonb), buzz.accept_events(jsonb, integer),
  buzz.accept_plain(buzz.events), buzz.accept_dm_message(buzz.events, text), buzz.accept_ephemeral(buzz.events),
  buzz.replace_head(buzz.events), buzz.accept_replaceable(buzz.events, text), buzz.accept_deletion(buzz.events),
  buzz.accept_gift_wrap(buzz.events, text), buzz.accept_reminder(buzz.events, text),
  buzz.accept_dm_command(buzz.events), buzz.plain_events(jsonb), buzz.accept_plain_run(jsonb, integer, integer)
  FROM PUBLIC;
