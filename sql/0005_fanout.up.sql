-- Fan-out bookkeeping: every `buzzpg serve` process owns one named logical replication slot
-- (buzz_<instance id>) and keeps a heartbeat row in buzz.instances. Named slots survive walsender
-- kills and PostgreSQL restarts (so a reconnect backfills what was missed), but a crashed process
-- leaves its slot behind, pinning WAL. Live processes therefore reap the slots of instances that
-- stopped heart-beating (buzz.reap_instances), and a graceful shutdown drops its own slot.

-- Register or refresh an instance (the heartbeat). Idempotent; re-creates a row a reaper deleted
-- while the process was paused.
CREATE FUNCTION buzz.instance_heartbeat(p_instance text, p_slot text, p_listen text DEFAULT NULL)
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

-- Drop what dead instances left behind, in the current database only:
--  * inactive logical slots named buzz_% whose instance is silent for longer than p_stale, or that
--    have no instance row at all (a process registers before it creates its slot, so a slot
--    without a row belongs to an instance that was already reaped or removed by hand);
--  * instance rows silent for longer than p_stale whose slot is gone.
-- An ACTIVE slot is never dropped: a walsender still streams it to someone. A crashed process's
-- walsender exits as soon as the server sees the socket close (kill -9 closes it at once), or after
-- wal_sender_timeout when the peer vanished without closing (network loss).
-- Concurrent reapers are harmless: a slot that is already gone or became active is skipped.
CREATE FUNCTION buzz.reap_instances(p_stale interval)
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

-- What an operator looks at: each instance, its slot, how long it has been silent and how much
-- WAL its slot retains.
CREATE FUNCTION buzz.fanout_status()
RETURNS TABLE (instance_id text, slot_name text, silent_for interval, slot_active boolean,
               retained_wal_bytes numeric, confirmed_flush_lsn pg_lsn)
LANGUAGE sql STABLE AS $$
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
