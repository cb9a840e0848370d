-- Fan-out bookkeeping: relay instances and their replication slots, and the member-change
-- announcements that tell every relay to forget cached member sets.

CREATE FUNCTION buzz.instance_heartbeat(p_instance text, p_slot text, p_listen text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
BEGIN
  -- The reaper finds an instance's slot by this name; no slot is named '' (or NULL).
  IF coalesce(p_instance, '') = '' THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_instance is empty');
  END IF;
  IF coalesce(p_slot, '') = '' THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_slot is empty');
  END IF;
  INSERT INTO buzz.instances AS i (instance_id, slot_name, listen_addr)
  VALUES (p_instance, p_slot, p_listen)
  ON CONFLICT (instance_id) DO UPDATE
     SET heartbeat_at = now(),
         slot_name    = EXCLUDED.slot_name,
         listen_addr  = coalesce(EXCLUDED.listen_addr, i.listen_addr);
END $$;
COMMENT ON FUNCTION buzz.instance_heartbeat(text, text, text) IS
  'Registers a buzzpg serve process or refreshes its heartbeat. Called every few seconds by each process. Raises BZ400 (invalid:), writing nothing, for an empty or NULL p_instance or p_slot.';

-- Drop what dead instances left behind, in the current database only:
--  * inactive logical slots named buzz_% whose instance is silent for longer than p_stale, or that
--    have no instance row at all (a process registers before it creates its slot, so a slot
--    without a row belongs to an instance that was already reaped or removed by hand);
--  * instance rows silent for longer than p_stale whose slot is gone.
-- An ACTIVE slot is never dropped: a walsender still streams it to someone. A crashed process's
-- walsender exits as soon as the server sees the socket close, or after wal_sender_timeout when
-- the peer vanished without closing. Concurrent reapers are harmless: a slot that is already gone
-- or became active is skipped.
CREATE FUNCTION buzz.reap_instances(p_stale interval)
RETURNS TABLE (slot_name text, instance_id text, action text)
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  r record;
BEGIN
  -- Before any slot is dropped: with a NULL p_stale the slots without an instance row still went,
  -- and a negative one counts every instance as silent.
  IF p_stale IS NULL OR p_stale < interval '0' THEN
    PERFORM buzz.reject('BZ400', 'invalid: p_stale must be an interval of zero or more');
  END IF;
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
  'Needs the REPLICATION attribute (or superuser) to drop slots. Raises BZ400 (invalid:), dropping nothing, for '
  'a NULL or negative p_stale.';

-- What an operator looks at: each instance, its slot, how long it has been silent and how much
-- WAL its slot retains.
CREATE FUNCTION buzz.fanout_status()
RETURNS TABLE (instance_id text, slot_name text, silent_for interval, slot_active boolean,
               retained_wal_bytes numeric, confirmed_flush_lsn pg_lsn)
LANGUAGE sql STABLE
SET search_path = pg_catalog, buzz, pg_temp
AS $$
  SELECT i.instance_id, coalesce(i.slot_name, s.slot_name::text), now() - i.heartbeat_at, s.active,
         pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn), s.confirmed_flush_lsn
    FROM buzz.instances i
    FULL JOIN (SELECT * FROM pg_replication_slots
                WHERE database = current_database() AND slot_name LIKE 'buzz\_%') s
      ON s.slot_name::text = i.slot_name
   ORDER BY 1, 2;
$$;
COMMENT ON FUNCTION buzz.fanout_status() IS
  'Fan-out health: instances, their replication slots, heartbeat age and retained WAL.';

-- Two transactions inserting the first member rows of one channel at once each see only their
-- own rows, so both could stay quiet; a relay that looked the set up between the two commits would
-- cache the first one's members and never learn of the second's. Inserters of a channel that looks
-- empty take a transaction-scoped advisory lock on it (sorted, before the check): the second waits
-- for the first's commit and, checking with a fresh statement snapshot, sees its rows and
-- announces. Under REPEATABLE READ or SERIALIZABLE the snapshot is the transaction's, so an insert
-- there always announces.
CREATE FUNCTION buzz.members_changed() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, buzz, pg_temp
AS $$
DECLARE
  chans text[];
  empty_chans text[];
  ins_chan text;
BEGIN
  CASE TG_OP
    WHEN 'TRUNCATE' THEN
      PERFORM pg_logical_emit_message(true, 'buzz', '{"t":"members","all":true}');
      RETURN NULL;
    WHEN 'INSERT' THEN
      -- A channel whose every member row this statement inserted (a DM open) has no cached set
      -- anywhere: an empty set is never cached, and a delete that emptied it was announced. Say
      -- nothing for it. Any other member row of the channel, however recently written, means a
      -- set may be cached.
      IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- Our snapshot is the transaction's: it cannot see a concurrent first inserter's rows
        -- even once they commit, so there is no telling an empty channel. Announce.
        SELECT array_agg(DISTINCT channel_id::text) INTO chans FROM members_new;
      ELSE
        SELECT coalesce(array_agg(ch::text) FILTER (WHERE others), '{}'),
               coalesce(array_agg(ch::text ORDER BY ch::text) FILTER (WHERE NOT others), '{}')
          INTO chans, empty_chans
          FROM (SELECT n.ch, EXISTS (SELECT 1 FROM buzz.members m
                                      WHERE m.channel_id = n.ch
                                        AND NOT EXISTS (SELECT 1 FROM members_new x
                                                         WHERE x.channel_id = m.channel_id AND x.pubkey = m.pubkey)) AS others
                  FROM (SELECT DISTINCT channel_id AS ch FROM members_new) n) s;
        -- A concurrent first insert into one of the channels that look empty would look the same
        -- to its own statement, and both would stay quiet. Their inserters take the channel's
        -- lock (sorted; only channels that look empty, so ordinary edits take none) and hold it
        -- to commit, then check again with a new snapshot: the second one sees the first's rows.
        FOREACH ins_chan IN ARRAY empty_chans LOOP
          PERFORM pg_advisory_xact_lock(pg_catalog.hashtextextended('members:' || ins_chan, 0::bigint));
        END LOOP;
        chans := chans || ARRAY(SELECT e FROM unnest(empty_chans) e
                                 WHERE EXISTS (SELECT 1 FROM buzz.members m
                                                WHERE m.channel_id = e::uuid
                                                  AND NOT EXISTS (SELECT 1 FROM members_new x
                                                                   WHERE x.channel_id = m.channel_id AND x.pubkey = m.pubkey)));
        IF cardinality(chans) = 0 THEN
          chans := NULL;
        END IF;
      END IF;
    WHEN 'DELETE' THEN
      SELECT array_agg(DISTINCT channel_id::text) INTO chans FROM members_old;
    ELSE
      chans := ARRAY(SELECT DISTINCT c FROM unnest(ARRAY[OLD.channel_id::text, NEW.channel_id::text]) c);
  END CASE;
  IF chans IS NOT NULL THEN
    PERFORM pg_logical_emit_message(true, 'buzz',
      jsonb_build_object('t', 'members', 'channels', to_jsonb(chans))::text);
  END IF;
  RETURN NULL;
END $$;
COMMENT ON FUNCTION buzz.members_changed() IS
  'Trigger: member rows were inserted, deleted, moved to another channel or pubkey, or truncated; tells every relay (a ''members'' logical message) to forget its cached member sets of those channels. Inserters of one channel serialise on a transaction-scoped advisory lock (''members:<channel id>'') so that concurrent first inserts cannot both stay quiet.';

CREATE TRIGGER members_inserted AFTER INSERT ON buzz.members
  REFERENCING NEW TABLE AS members_new FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_changed();

CREATE TRIGGER members_deleted AFTER DELETE ON buzz.members
  REFERENCING OLD TABLE AS members_old FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_changed();

CREATE TRIGGER members_moved AFTER UPDATE OF channel_id, pubkey ON buzz.members
  FOR EACH ROW WHEN ((OLD.channel_id, OLD.pubkey) IS DISTINCT FROM (NEW.channel_id, NEW.pubkey))
  EXECUTE FUNCTION buzz.members_changed();

CREATE TRIGGER members_truncated AFTER TRUNCATE ON buzz.members
  FOR EACH STATEMENT EXECUTE FUNCTION buzz.members_changed();
