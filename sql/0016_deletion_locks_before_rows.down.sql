-- Back to 0015's apply_deletion (addresses, then ids, each locked as it is deleted).

DROP FUNCTION IF EXISTS buzz.deletion_addresses(text, jsonb);

CREATE OR REPLACE FUNCTION buzz.apply_deletion(author text, del_id text, del_created_at bigint, p_tags jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  target text;
  addr text;
  parts text[];
  k integer;
  d text;
BEGIN
  FOREACH addr IN ARRAY ARRAY(SELECT DISTINCT a FROM unnest(buzz.tag_values(p_tags, 'a')) a ORDER BY a) LOOP
    parts := regexp_match(addr, '^([0-9]{1,5}):([0-9a-f]{64}):(.*)$');
    CONTINUE WHEN parts IS NULL OR parts[2] <> author;
    k := parts[1]::integer;
    CONTINUE WHEN buzz.kind_class(k) NOT IN ('replaceable', 'addressable');
    d := CASE WHEN buzz.kind_class(k) = 'replaceable' THEN '' ELSE parts[3] END;
    PERFORM pg_advisory_xact_lock(hashtextextended(k || ':' || author || ':' || d, 0));  -- see accept_event
    DELETE FROM buzz.events
     WHERE kind = k AND pubkey = author AND created_at <= del_created_at
       AND (buzz.kind_class(k) = 'replaceable' OR d_tag = d);
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), lease_until = NULL
     WHERE k = 30300 AND pubkey = author AND d_tag = d AND created_at <= del_created_at
       AND state IN ('armed', 'claimed');
    INSERT INTO buzz.deleted_addresses AS da (kind, pubkey, d_tag, until_created_at)
    VALUES (k, author, d, del_created_at)
    ON CONFLICT (kind, pubkey, d_tag) DO UPDATE
      SET until_created_at = greatest(da.until_created_at, EXCLUDED.until_created_at);
  END LOOP;
  FOREACH target IN ARRAY ARRAY(SELECT DISTINCT t FROM unnest(buzz.tag_values(p_tags, 'e')) t ORDER BY t) LOOP
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
END $$;
COMMENT ON FUNCTION buzz.apply_deletion(text, text, bigint, jsonb) IS
  'NIP-09: deletes the author''s own versions of a-tag addresses up to the request''s created_at and events named by e tags (leaving tombstones); cancels affected reminders. Locks in acceptance''s order: addresses, then ids, each sorted and taken once.';
