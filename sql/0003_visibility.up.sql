-- Visibility (NIP-DV): per-viewer generations, the outbox, the publication fence, operator
-- hide/unhide, the guards that keep generations from repeating, and the lag views.
--
-- Every change of a member's hidden state bumps that viewer's target generation and upserts
-- their outbox row, in the transaction that made the change. Triggers on buzz.members do it, so
-- a raw UPDATE from psql converges exactly like the protocol commands. A publisher holding
-- generation g never overwrites a snapshot of a generation above g (I3): that holds only while
-- a number names one state of a viewer, so generation numbers never repeat, not even across a
-- reset (a deleted visibility_state row).

-------------------------------------------------------------------------------------------------
-- Generations.

CREATE FUNCTION buzz.bump_visibility(v text) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF TG_OP = 'DELETE' THEN
    PERFORM buzz.bump_visibility(OLD.pubkey);
  ELSE
    PERFORM buzz.bump_visibility(NEW.pubkey);
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_hidden_changed() IS
  'Trigger: a member row was hidden or re-opened (or inserted or deleted hidden); bumps that viewer''s generation.';

-- A raw UPDATE that moves a hidden member row to another pubkey or channel changes the hidden
-- sets of both viewers.
CREATE FUNCTION buzz.members_hidden_moved() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- Viewer state rows in viewer order (the documented lock order).
  PERFORM buzz.bump_visibility(v)
     FROM (SELECT DISTINCT v FROM unnest(ARRAY[OLD.pubkey, NEW.pubkey]) AS u(v)) x
    ORDER BY v;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_hidden_moved() IS
  'Trigger: a hidden member row moved to another pubkey or channel (raw UPDATE) bumps the generation of the old and the new viewer.';

-- A reset (DELETE of a viewer's visibility_state row) leaves the row's highest generation here,
-- and a row inserted for that viewer later starts above it: every read from before the reset is
-- 'stale' at the fence. A negative generation stays allowed: it lifts the next state row below
-- zero, but never to a number used before.
CREATE FUNCTION buzz.retire_generation(p_viewer text, p_generation bigint) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- No state row can have another viewer, and rows of this table are kept for good.
  IF NOT buzz.is_hex64(p_viewer) THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_viewer must be 64 lowercase hex characters');
  END IF;
  IF p_generation IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_generation is NULL');
  END IF;
  INSERT INTO buzz.visibility_retired AS r (viewer, generation) VALUES (p_viewer, p_generation)
  ON CONFLICT (viewer) DO UPDATE SET generation = EXCLUDED.generation
   WHERE EXCLUDED.generation > r.generation;
END $$;
COMMENT ON FUNCTION buzz.retire_generation(text, bigint) IS
  'Records that p_viewer''s generations up to p_generation were used (keeping the maximum): a visibility_state row inserted for that viewer later starts above it. Raises BZ400 (invalid:), recording nothing, when p_viewer is not 64 lowercase hex characters or p_generation is NULL.';

-- A reset of a viewer with an unpublished change leaves it pending: without that, the change
-- was lost until the viewer's next one. The new row starts above the retired generation. This
-- AFTER DELETE trigger fires after the outbox row's ON DELETE CASCADE (triggers fire in name
-- order, and the foreign key's "RI_ConstraintTrigger_a_..." sorts first), so the new outbox row
-- stays.
CREATE FUNCTION buzz.visibility_state_retire() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  PERFORM buzz.retire_generation(OLD.viewer, greatest(OLD.target_generation, OLD.published_generation));
  IF OLD.target_generation > OLD.published_generation THEN
    PERFORM buzz.bump_visibility(OLD.viewer);
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_retire() IS
  'Trigger (AFTER DELETE on visibility_state, per row): records the deleted row''s highest generation in visibility_retired, keeping the maximum; a row with an unpublished change is made again, pending above it, so the reset does not lose that change.';

-- TRUNCATE fires no row triggers: this records what the delete trigger would, one statement at
-- a time.
CREATE FUNCTION buzz.visibility_state_retire_all() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- TRUNCATE fires no row triggers; it holds ACCESS EXCLUSIVE on the table already, so this reads
  -- every row that is about to go.
  PERFORM buzz.retire_generation(s.viewer, greatest(s.target_generation, s.published_generation))
     FROM buzz.visibility_state s;
  INSERT INTO buzz.visibility_reset_pending (viewer)
  SELECT viewer FROM buzz.visibility_state WHERE target_generation > published_generation
  ON CONFLICT DO NOTHING;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_retire_all() IS
  'Trigger (BEFORE TRUNCATE on visibility_state): records every row''s highest generation in visibility_retired, as the delete trigger would one row at a time, and the viewers with an unpublished change in visibility_reset_pending.';

-- Costs: every bump runs this trigger (the upsert's conflict check comes after it), one index
-- probe of buzz.visibility_retired, normally empty.
CREATE FUNCTION buzz.visibility_state_lift() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE retired bigint;
BEGIN
  SELECT r.generation INTO retired FROM buzz.visibility_retired r WHERE r.viewer = NEW.viewer;
  IF retired IS NOT NULL THEN
    NEW.published_generation := NEW.published_generation + retired;
    NEW.target_generation := NEW.target_generation + retired;
  END IF;
  RETURN NEW;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_lift() IS
  'Trigger (BEFORE INSERT on visibility_state, per row): a viewer with a retired generation R starts again above it: published and target are both lifted by R (published <= target and pending-ness kept). Also runs for an upsert that ends in its UPDATE branch, where the lifted values are unused.';

-- Under REPEATABLE READ or SERIALIZABLE the check reads the transaction's snapshot and can miss a
-- reset committed after it; buzzpg's own writers run at READ COMMITTED.
CREATE FUNCTION buzz.visibility_state_check_lift() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- The race the BEFORE trigger cannot see: a reset still uncommitted when it read
  -- visibility_retired, whose deleted row this insert then waited for (unique check or upsert
  -- lock) and replaced. This statement's snapshot is newer than that wait, so it sees the reset.
  IF EXISTS (SELECT 1 FROM buzz.visibility_retired r
              WHERE r.viewer = NEW.viewer AND r.generation > NEW.published_generation) THEN
    RAISE EXCEPTION USING ERRCODE = 'serialization_failure',
      MESSAGE = 'visibility state of ' || NEW.viewer || ' was reset concurrently; retry',
      HINT = 'buzzpg retries SQLSTATE 40001; from psql, run the statement again.';
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_check_lift() IS
  'Trigger (AFTER INSERT on visibility_state, per row; fires only when a row was really inserted): refuses with SQLSTATE 40001 a new row whose published generation is below a retired generation of its viewer (a reset committed while the insert was under way); the retry is lifted.';

-- Generations never go down, and a row keeps its viewer. buzzpg's writers never do either: a
-- bump raises the target, the fence raises the published generation. The trigger has a WHEN
-- clause, so the comparison runs in the executor and PL/pgSQL runs only for a write it refuses
-- (every bump and publication updates the state row).
CREATE FUNCTION buzz.visibility_state_guard() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF NEW.viewer <> OLD.viewer THEN
    PERFORM buzz.reject('BZ400', 'invalid: a visibility_state row keeps its viewer (the other viewer''s generations would repeat); to reset a viewer, DELETE its row: its next change starts above the generations it used');
  END IF;
  PERFORM buzz.reject('BZ400', 'invalid: visibility generations never go down (a publisher still holding a lower one could overwrite newer state); to reset a viewer, DELETE its visibility_state row: its next change starts above the generations it used');
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_state_guard() IS
  'Trigger (BEFORE UPDATE on visibility_state, per row, only when its WHEN clause holds): refuses with BZ400 (invalid:) an UPDATE that lowers target_generation or published_generation or changes the viewer, which would let generation numbers repeat (I3). A viewer is reset by deleting its row.';

-- Retired generations only rise (retire_generation keeps the maximum) and are kept for good.
CREATE FUNCTION buzz.visibility_retired_guard() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    PERFORM buzz.reject('BZ400', 'invalid: a retired generation only rises and keeps its viewer (buzz.retire_generation keeps the maximum); lowering or moving it lets generations repeat');
  END IF;
  PERFORM buzz.reject('BZ400', 'invalid: rows of visibility_retired are kept for good (without them a reset viewer''s generations would repeat); to reset a viewer, DELETE its visibility_state row');
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_retired_guard() IS
  'Trigger (BEFORE UPDATE per row when it lowers the generation or changes the viewer, BEFORE DELETE per row, BEFORE TRUNCATE on visibility_retired): refuses the write with BZ400 (invalid:), since a viewer whose retired generation is lowered or gone could be issued its old generation numbers again (I3).';

-- TRUNCATE of buzz.members (or of buzz.channels CASCADE) fires no row triggers, yet it empties
-- hidden sets. The BEFORE TRUNCATE trigger records the viewers while the rows are still there to
-- read (the statement holds ACCESS EXCLUSIVE); the first AFTER TRUNCATE trigger bumps them once
-- every table of the statement is truncated, so one TRUNCATE may name members and
-- visibility_state in any order.
CREATE FUNCTION buzz.members_hidden_truncated() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  INSERT INTO buzz.visibility_reset_pending (viewer)
  SELECT DISTINCT pubkey FROM buzz.members WHERE hidden_at IS NOT NULL
  ON CONFLICT DO NOTHING;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_hidden_truncated() IS
  'Trigger (BEFORE TRUNCATE on members, also when a TRUNCATE of channels cascades to it): records every viewer who had a DM hidden in visibility_reset_pending; visibility_reset_bump bumps them once the statement''s tables are truncated, as the row triggers would have one row at a time.';

-- Viewers are bumped sorted by pubkey (lock order: viewer state by viewer), after the
-- statement's table locks.
CREATE FUNCTION buzz.visibility_reset_bump() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  PERFORM buzz.bump_visibility(p.viewer)
     FROM (SELECT viewer FROM buzz.visibility_reset_pending ORDER BY viewer) p;
  DELETE FROM buzz.visibility_reset_pending;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_reset_bump() IS
  'Trigger (AFTER TRUNCATE on members and on visibility_state): bumps every viewer the BEFORE TRUNCATE triggers recorded in visibility_reset_pending (a hidden set emptied, or an unpublished change reset), above any retired generation, and empties it.';

CREATE TRIGGER members_hidden_update AFTER UPDATE OF hidden_at ON buzz.members
  FOR EACH ROW WHEN ((OLD.hidden_at IS NULL) IS DISTINCT FROM (NEW.hidden_at IS NULL))
  EXECUTE FUNCTION buzz.members_hidden_changed();

CREATE TRIGGER members_hidden_insert AFTER INSERT ON buzz.members
  FOR EACH ROW WHEN (NEW.hidden_at IS NOT NULL)
  EXECUTE FUNCTION buzz.members_hidden_changed();

CREATE TRIGGER members_hidden_delete AFTER DELETE ON buzz.members
  FOR EACH ROW WHEN (OLD.hidden_at IS NOT NULL)
  EXECUTE FUNCTION buzz.members_hidden_changed();

CREATE TRIGGER members_hidden_moved AFTER UPDATE OF channel_id, pubkey ON buzz.members
  FOR EACH ROW WHEN ((OLD.hidden_at IS NOT NULL OR NEW.hidden_at IS NOT NULL)
                     AND (OLD.channel_id, OLD.pubkey) IS DISTINCT FROM (NEW.channel_id, NEW.pubkey))
  EXECUTE FUNCTION buzz.members_hidden_moved();

CREATE TRIGGER members_hidden_truncate BEFORE TRUNCATE ON buzz.members
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_hidden_truncated();

CREATE TRIGGER members_hidden_truncated AFTER TRUNCATE ON buzz.members
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_reset_bump();

-- Lock order: a reset takes the retired row after the state row (viewer state by viewer, then
-- this table by viewer); the insert path reads buzz.visibility_retired without locking it.
CREATE TRIGGER visibility_state_retire AFTER DELETE ON buzz.visibility_state
  FOR EACH ROW EXECUTE FUNCTION buzz.visibility_state_retire();

CREATE TRIGGER visibility_state_retire_all BEFORE TRUNCATE ON buzz.visibility_state
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_state_retire_all();

CREATE TRIGGER visibility_state_reset_pending AFTER TRUNCATE ON buzz.visibility_state
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_reset_bump();

CREATE TRIGGER visibility_state_lift BEFORE INSERT ON buzz.visibility_state
  FOR EACH ROW EXECUTE FUNCTION buzz.visibility_state_lift();

CREATE TRIGGER visibility_state_check_lift AFTER INSERT ON buzz.visibility_state
  FOR EACH ROW EXECUTE FUNCTION buzz.visibility_state_check_lift();

CREATE TRIGGER visibility_state_guard BEFORE UPDATE ON buzz.visibility_state
  FOR EACH ROW WHEN (NEW.target_generation < OLD.target_generation
                     OR NEW.published_generation < OLD.published_generation
                     OR NEW.viewer <> OLD.viewer)
  EXECUTE FUNCTION buzz.visibility_state_guard();

CREATE TRIGGER visibility_retired_guard_update BEFORE UPDATE ON buzz.visibility_retired
  FOR EACH ROW WHEN (NEW.generation < OLD.generation OR NEW.viewer <> OLD.viewer)
  EXECUTE FUNCTION buzz.visibility_retired_guard();

CREATE TRIGGER visibility_retired_guard_delete BEFORE DELETE ON buzz.visibility_retired
  FOR EACH ROW EXECUTE FUNCTION buzz.visibility_retired_guard();

CREATE TRIGGER visibility_retired_guard_truncate BEFORE TRUNCATE ON buzz.visibility_retired
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.visibility_retired_guard();

-------------------------------------------------------------------------------------------------
-- The outbox.

-- Wake listeners when outbox work appears. Constant payload (never the row); PostgreSQL folds
-- identical notifications of one transaction into one. Claims and backoff releases do not notify.
CREATE FUNCTION buzz.visibility_outbox_notify() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  PERFORM pg_notify('buzz_visibility', '');
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.visibility_outbox_notify() IS
  'Trigger: outbox work became available; NOTIFY buzz_visibility (empty payload) wakes the publishers.';

CREATE TRIGGER visibility_outbox_notify AFTER INSERT OR UPDATE ON buzz.visibility_outbox
  FOR EACH ROW WHEN (NEW.claim_id IS NULL AND NEW.available_at <= now())
  EXECUTE FUNCTION buzz.visibility_outbox_notify();

-- How long a viewer has been pending counts from its oldest unpublished change. A publication
-- that leaves newer work behind keeps the outbox row; without this its enqueued_at stayed at the
-- row's birth, and a viewer whose DMs kept changing showed a lag growing without bound. The
-- viewer's latest change is no older than the first unpublished one, so the figure errs by less
-- than one publication.
CREATE FUNCTION buzz.outbox_pending_since_change() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  UPDATE buzz.visibility_outbox o SET enqueued_at = NEW.changed_at
   WHERE o.viewer = NEW.viewer AND o.enqueued_at < NEW.changed_at;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.outbox_pending_since_change() IS
  'Trigger: a publication left a newer generation pending; its outbox row counts from the viewer''s latest change, not from when the row was first made.';

-- Row lock order as every writer: the state row (held by the publication), then the outbox row.
CREATE TRIGGER visibility_state_left_pending AFTER UPDATE OF published_generation ON buzz.visibility_state
  FOR EACH ROW WHEN (NEW.published_generation > OLD.published_generation
                     AND NEW.target_generation > NEW.published_generation)
  EXECUTE FUNCTION buzz.outbox_pending_since_change();

-------------------------------------------------------------------------------------------------
-- Hide and re-open. hide_dm and unhide_dm are one-line wrappers of set_dm_hidden, which checks
-- the arguments for all three before any lock.

CREATE FUNCTION buzz.set_dm_hidden(viewer text, channel uuid, hide boolean) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE changed boolean;
BEGIN
  -- Arguments before any lock. A NULL hide took the ELSE branch below and re-opened the DM.
  IF NOT buzz.is_hex64(viewer) THEN
    PERFORM buzz.reject('BZ400', 'invalid: viewer must be 64 lowercase hex characters');
  END IF;
  IF channel IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: channel is NULL');
  END IF;
  IF hide IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: hide must be true or false');
  END IF;
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
COMMENT ON FUNCTION buzz.set_dm_hidden(text, uuid, boolean) IS
  'Hides (hide true) or re-opens (hide false) DM channel for viewer, under the DM lock (channel, then members by pubkey); hide_dm, unhide_dm and accept_event (41012, DM re-open) call it. Returns true when the hidden set changed; the generation bump and outbox row follow through the members trigger. SQLSTATE BZ400 (invalid:), before any lock, when viewer is not 64 lowercase hex characters or channel or hide is NULL; BZ403 when the channel is unknown or viewer is not a member.';

CREATE FUNCTION buzz.hide_dm(viewer text, channel uuid) RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$ SELECT buzz.set_dm_hidden(viewer, channel, true) $$;
COMMENT ON FUNCTION buzz.hide_dm(text, uuid) IS
  'Operator hide: hides DM channel for viewer (same effect as a kind 41012 from viewer). Returns true when the hidden set changed; the generation bump and outbox row follow through the members trigger. SQLSTATE BZ400 when viewer is not 64 lowercase hex characters or channel is NULL (text that is not a UUID fails PostgreSQL''s uuid input, 22P02, before the call); BZ403 when the channel is unknown or viewer is not a member.';

CREATE FUNCTION buzz.unhide_dm(viewer text, channel uuid) RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$ SELECT buzz.set_dm_hidden(viewer, channel, false) $$;
COMMENT ON FUNCTION buzz.unhide_dm(text, uuid) IS
  'Operator re-open: makes DM channel visible again for viewer. Returns true when the hidden set changed. SQLSTATE BZ400 when viewer is not 64 lowercase hex characters or channel is NULL (text that is not a UUID fails PostgreSQL''s uuid input, 22P02, before the call); BZ403 when the channel is unknown or viewer is not a member.';

-------------------------------------------------------------------------------------------------
-- Publication. The SQL API refuses bad arguments from psql the way accept_event refuses a bad
-- event: SQLSTATE BZ400 with a message starting 'invalid:', raised before anything is locked or
-- changed. Every fence (generation, created_at, claim id, stamp) stays as strict: where a NULL can
-- only fail such a check, the function answers as for any stale caller and changes nothing. Text
-- that is not a UUID, passed for a uuid argument, fails with 22P02 before the call.

-- ONE statement, hence one snapshot: generation and hidden set are read together.
CREATE FUNCTION buzz.visibility_source(viewer text,
                                                  OUT generation bigint, OUT hidden uuid[], OUT created_at_floor bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- Any other text has no state and no DM: its zeros would read as a real viewer with nothing hidden.
  IF NOT buzz.is_hex64($1) THEN
    PERFORM buzz.reject('BZ400', 'invalid: viewer must be 64 lowercase hex characters');
  END IF;
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
  'NIP-DV source of one viewer''s snapshot, read in ONE snapshot: target generation, hidden DM channel ids (sorted), and created_at floor = newest created_at of any kind 30622 with d = viewer by any author (or the recorded published one). A snapshot built from it must use created_at > floor. Raises BZ400 (invalid:) for a viewer that is not 64 lowercase hex characters (NULL included).';

-- The snapshot's shape, before any lock. Every test is NULL-safe: a NULL is not false, so a
-- missing field would pass a plain comparison.
CREATE FUNCTION buzz.check_snapshot(viewer text, generation bigint, ev jsonb, relay_pk text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  IF jsonb_typeof(ev) IS DISTINCT FROM 'object' OR NOT buzz.is_hex64(ev->>'id')
     OR jsonb_typeof(ev->'sig') IS DISTINCT FROM 'string' OR (ev->>'sig') !~ '^[0-9a-f]{128}$'
     OR jsonb_typeof(ev->'created_at') IS DISTINCT FROM 'number'
     OR (ev->>'created_at') !~ '^[0-9]{1,16}$' OR jsonb_typeof(ev->'tags') IS DISTINCT FROM 'array'
     OR NOT buzz.is_hex64(viewer) THEN
    PERFORM buzz.reject('BZ400', 'invalid: malformed snapshot');
  END IF;
  -- A NULL generation fails every comparison of the fence, which then answered 'retry' or 'stale'.
  IF generation IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: generation is NULL');
  END IF;
  IF (ev->>'kind') IS DISTINCT FROM '30622' OR (ev->>'content') IS DISTINCT FROM '' THEN
    PERFORM buzz.reject('BZ400', 'invalid: a snapshot is kind 30622 with empty content');
  END IF;
  IF relay_pk = '' OR (ev->>'pubkey') IS DISTINCT FROM relay_pk THEN
    PERFORM buzz.reject('BZ400', 'invalid: a snapshot is signed by the relay key');
  END IF;
  -- Tag shape on its own, before anything calls tag_values: it is IMMUTABLE, so the planner folds
  -- it on the event before the other tests of its IF, and it fails on a tag that is not an array.
  IF EXISTS (SELECT 1 FROM jsonb_array_elements(ev->'tags') t
              WHERE jsonb_typeof(t) <> 'array' OR jsonb_array_length(t) < 2
                 OR EXISTS (SELECT 1 FROM jsonb_array_elements(t) x WHERE jsonb_typeof(x) <> 'string')) THEN
    PERFORM buzz.reject('BZ400', 'invalid: snapshot tags are arrays of two or more strings');
  END IF;
  IF EXISTS (SELECT 1 FROM jsonb_array_elements(ev->'tags') t
              WHERE t->>0 NOT IN ('d', 'p', 'h')
                 OR (t->>0 = 'h' AND t->>1 !~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'))
     OR buzz.tag_values(ev->'tags', 'd') IS DISTINCT FROM ARRAY[viewer]
     OR buzz.tag_values(ev->'tags', 'p') IS DISTINCT FROM ARRAY[viewer] THEN
    PERFORM buzz.reject('BZ400', 'invalid: a snapshot has d = p = viewer and h = channel ids');
  END IF;
END $$;
COMMENT ON FUNCTION buzz.check_snapshot(text, bigint, jsonb, text) IS
  'Refuses with BZ400 (invalid:) a snapshot publish_visibility_snapshot must not store: a field missing or malformed, sig included, a viewer that is not 64 lowercase hex characters, a NULL generation, a kind other than 30622 or non-empty content, an author other than relay_pk, tags not arrays of two or more strings, d/p not the viewer, h not channel ids.';

CREATE FUNCTION buzz.publish_visibility_snapshot(viewer text, generation bigint, ev jsonb)
RETURNS text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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
  PERFORM buzz.check_snapshot(v, g, ev, relay_pk);
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
  'NIP-DV fenced replace of viewer''s kind 30622 head with ev (built from visibility_source at generation, id and signature VERIFIED BY THE CALLER; execute granted to buzz_relay and buzz_operator only). Returns ''published'' (head replaced, published_generation = generation, outbox row cleared unless a newer generation arrived), ''stale'' (a generation >= this one is already published; a covered outbox row is cleared) or ''retry'' (created_at not above every earlier 30622 of the viewer by any key, or more than snapshot_max_ahead_seconds ahead of the database clock: re-read, wait for the clock, rebuild; nothing changed). Raises BZ400 (invalid:), before taking any lock, for a malformed snapshot (a field missing, sig included, tags not arrays of strings, wrong kind, author other than the relay key, d/p not the viewer, h not channel ids), a viewer that is not 64 lowercase hex characters, or a NULL generation.';

-- Batch form: the same, and the three arrays must line up.
CREATE FUNCTION buzz.publish_visibility_snapshots(viewers text[], generations bigint[], evs jsonb[])
RETURNS TABLE (viewer text, outcome text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  n integer := coalesce(array_length(viewers, 1), 0);
BEGIN
  -- Elements are paired by subscript 1 .. n. An array of more dimensions, or one indexed from
  -- elsewhere, would pair a viewer's snapshot with another viewer's generation. (An empty or NULL
  -- array has no dimensions: the tests below are NULL for it, and n counts it as 0.)
  IF array_ndims(viewers) > 1 OR array_ndims(generations) > 1 OR array_ndims(evs) > 1
     OR array_lower(viewers, 1) <> 1 OR array_lower(generations, 1) <> 1 OR array_lower(evs, 1) <> 1 THEN
    PERFORM buzz.reject('BZ400', 'invalid: viewers, generations and events must be one-dimensional arrays indexed from 1');
  END IF;
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
  'Batch of publish_visibility_snapshot in one transaction (callers VERIFIED ids and signatures; execute granted to buzz_relay and buzz_operator only). Returns each viewer''s outcome: published, stale, retry, or busy (its state row was locked by another transaction; nothing changed; publish it alone). Never waits for a state row while holding another, so it cannot deadlock with multi-viewer writers. Raises BZ400 (invalid:), and the whole batch changes nothing, when the arrays differ in length, are not one-dimensional arrays indexed from 1, or any element is one publish_visibility_snapshot refuses.';

-------------------------------------------------------------------------------------------------
-- Claims.

-- A lease of zero or less stays allowed: it makes a claim that is already expired (tests take one
-- on purpose), and the fence still orders publications.
CREATE FUNCTION buzz.claim_visibility_work(p_claim uuid, p_max integer, p_lease interval)
RETURNS TABLE (viewer text, generation bigint, attempts integer, pending_seconds double precision)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- A NULL claim id would lease rows to nobody: claimable by anyone at once, yet returned as ours.
  IF p_claim IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_claim is NULL');
  END IF;
  -- LIMIT NULL is no limit at all.
  IF p_max IS NULL OR p_max < 0 THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_max must be 0 or more');
  END IF;
  -- A claim without a lease is never recovered (a table constraint refuses it too, on any write).
  IF p_lease IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_lease is NULL (a claim without a lease is never recovered)');
  END IF;
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
  'Claims up to p_max fresh available outbox rows plus up to greatest(1, p_max / 4) rows in backoff (so rows that keep failing never starve fresh work, nor fresh work them), FOR UPDATE SKIP LOCKED, expired leases re-taken, under claim id p_claim until now() + p_lease. Commit it on its own: no lock is held afterwards. Commits with synchronous_commit off (a claim lost in a crash only makes the row claimable again). Raises BZ400 (invalid:), claiming nothing, for a NULL p_claim or p_lease, or a NULL or negative p_max.';

-- Failed publication: give the row back with capped exponential backoff, only while our claim
-- still holds (a newer generation cleared the claim and reset backoff: leave that alone).
CREATE FUNCTION buzz.release_visibility_claim(p_viewer text, p_claim uuid, p_error text,
                                                         p_base interval, p_cap interval)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  released boolean;
BEGIN
  -- least() skips NULLs: a NULL cap left the backoff uncapped; with a NULL base too, available_at
  -- became NULL. (A NULL viewer or claim id matches no claim: false, like any stale claimer.)
  IF p_base IS NULL OR p_cap IS NULL THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_base and p_cap must not be NULL');
  END IF;
  PERFORM set_config('synchronous_commit', 'off', true);  -- lost in a crash: the lease expires instead
  WITH r AS (
    UPDATE buzz.visibility_outbox o
       SET claim_id = NULL, lease_until = NULL, attempts = o.attempts + 1, last_error = left(p_error, 500),
           available_at = now() + least(p_cap, p_base * power(2::double precision, least(o.attempts, 30)::double precision))
     WHERE o.viewer = p_viewer AND o.claim_id = p_claim
    RETURNING 1)
  SELECT EXISTS (SELECT 1 FROM r) INTO released;
  RETURN released;
END $$;
COMMENT ON FUNCTION buzz.release_visibility_claim(text, uuid, text, interval, interval) IS
  'Gives a claimed outbox row back after a failed publication: attempts + 1, last_error, available again after least(p_cap, p_base * 2^attempts). Only while claim id p_claim still holds; returns whether it did. Raises BZ400 (invalid:), changing nothing, when p_base or p_cap is NULL.';

-- Graceful shutdown: give back unfinished claims at once (no backoff; the NOTIFY trigger wakes the
-- other listeners because the row becomes claim-free and available).
CREATE FUNCTION buzz.release_visibility_claims(p_claims uuid[])
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
  WITH r AS (
    UPDATE buzz.visibility_outbox o SET claim_id = NULL, lease_until = NULL
     WHERE o.claim_id = ANY (p_claims)
    RETURNING 1)
  SELECT count(*)::integer FROM r
$$;
COMMENT ON FUNCTION buzz.release_visibility_claims(uuid[]) IS
  'Releases every outbox row held under the given claim ids without backoff (graceful shutdown). Returns how many.';

-- The sweep's repair step: the state is the truth. Every pending viewer (partial index) gets an
-- outbox row; a row whose generation fell behind the target is raised. A row created for a viewer
-- published meanwhile is harmless: its publication comes back 'stale' and clears it.
CREATE FUNCTION buzz.sweep_visibility()
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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
LANGUAGE sql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
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
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- LIMIT refuses a negative count with 2201W. (NULL is LIMIT ALL: every row.)
  IF lim < 0 THEN
    PERFORM buzz.reject('BZ400', 'invalid: lim must be 0 or more');
  END IF;
  RETURN QUERY
  SELECT coalesce(s.viewer, o.viewer), s.target_generation, s.published_generation,
         extract(epoch FROM now() - coalesce(o.enqueued_at, s.changed_at))::double precision,
         o.attempts, o.last_error,
         greatest(0, extract(epoch FROM o.available_at - now()))::double precision,
         o.claim_id IS NOT NULL,
         extract(epoch FROM o.lease_until - now())::double precision
    FROM (SELECT * FROM buzz.visibility_state x WHERE x.target_generation > x.published_generation) s
    FULL JOIN buzz.visibility_outbox o ON o.viewer = s.viewer
   ORDER BY o.attempts DESC NULLS LAST, 4 DESC
   LIMIT lim;
END $$;
COMMENT ON FUNCTION buzz.visibility_lag_detail(integer) IS
  'NIP-DV operator detail: pending viewers and outbox rows, most failed attempts first, then oldest: generations, pending age, attempts, last error, seconds until the next attempt, claim and lease left. At most lim rows (default 100; NULL: all); BZ400 (invalid:) for a negative lim.';

REVOKE ALL ON FUNCTION buzz.publish_visibility_snapshot(text, bigint, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.publish_visibility_snapshots(text[], bigint[], jsonb[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.claim_visibility_work(uuid, integer, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.release_visibility_claim(text, uuid, text, interval, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.release_visibility_claims(uuid[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION buzz.sweep_visibility() FROM PUBLIC;

-- Operator entry points that write: they run as the owner, so buzz_operator needs no DML.

CREATE FUNCTION buzz.reset_visibility(p_viewer text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, buzz, pg_temp AS $$
BEGIN
  IF NOT buzz.is_hex64(p_viewer) THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_viewer must be 64 lowercase hex characters');
  END IF;
  -- The triggers retire the generations used so far and keep an unpublished change pending.
  DELETE FROM buzz.visibility_state s WHERE s.viewer = p_viewer;
  RETURN FOUND;
END $$;
COMMENT ON FUNCTION buzz.reset_visibility(text) IS
  'Operator reset of one viewer''s visibility state: deletes its state row (its generations are retired, never reused; an unpublished change stays pending). Returns true when a row was deleted. BZ400 (invalid:) when p_viewer is not 64 lowercase hex characters.';

CREATE FUNCTION buzz.retry_visibility(p_viewer text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, buzz, pg_temp AS $$
DECLARE
  n integer;
BEGIN
  IF p_viewer IS NOT NULL AND NOT buzz.is_hex64(p_viewer) THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_viewer must be 64 lowercase hex characters, or NULL for every row');
  END IF;
  -- Rows locked by viewer, the order of every other writer of several outbox rows.
  UPDATE buzz.visibility_outbox o SET available_at = now()
    FROM (SELECT x.viewer FROM buzz.visibility_outbox x
           WHERE (p_viewer IS NULL OR x.viewer = p_viewer) AND x.available_at > now()
           ORDER BY x.viewer FOR UPDATE) l
   WHERE o.viewer = l.viewer;
  GET DIAGNOSTICS n = ROW_COUNT;
  RETURN n;
END $$;
COMMENT ON FUNCTION buzz.retry_visibility(text) IS
  'Operator retry: makes p_viewer''s outbox row in backoff due now (NULL: every row in backoff); its attempts count stays. Returns the rows made due. BZ400 (invalid:) when p_viewer is neither NULL nor 64 lowercase hex characters.';
