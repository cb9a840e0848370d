-- A deletion takes every lock it needs before it touches a row, in acceptance's order:
--   1. the advisory lock of each e target, sorted (accept_event takes event:<id> first);
--   2. the address lock of each a target, sorted by lock key (accept_event takes it second);
--   3. then the deletes, cancels and tombstones.
-- 0015 took addresses before ids so that no deletion held a version's row while it waited for
-- an address lock. Acceptance goes the other way, though: accepting X holds event:X and then waits
-- for X's address, so a deletion naming X by a and by e that got the address first waited for
-- event:X, and PostgreSQL broke the cycle after deadlock_timeout (1 s). Holding only advisory
-- locks while it waits, the deletion can now wait in acceptance's order: it holds no row anyone
-- else waits for until it has everything.

CREATE FUNCTION buzz.deletion_addresses(author text, p_tags jsonb)
RETURNS TABLE (kind integer, d_tag text, lock_key text) LANGUAGE sql STABLE AS $$
  SELECT DISTINCT k, d, k || ':' || author || ':' || d
    FROM (SELECT m[1]::integer AS k,
                 CASE WHEN buzz.kind_class(m[1]::integer) = 'replaceable' THEN '' ELSE m[3] END AS d
            FROM unnest(buzz.tag_values(p_tags, 'a')) a,
                 LATERAL regexp_match(a, '^([0-9]{1,5}):([0-9a-f]{64}):(.*)$') m
           WHERE m IS NOT NULL AND m[2] = author
             AND buzz.kind_class(m[1]::integer) IN ('replaceable', 'addressable')) s
   ORDER BY 3
$$;
COMMENT ON FUNCTION buzz.deletion_addresses(text, jsonb) IS
  'The author''s replaceable and addressable addresses a NIP-09 request names in a tags, sorted by the advisory lock key accept_event takes for each (kind:pubkey:d, with no d for a replaceable kind).';

CREATE OR REPLACE FUNCTION buzz.apply_deletion(author text, del_id text, del_created_at bigint, p_tags jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  ids text[] := ARRAY(SELECT DISTINCT t FROM unnest(buzz.tag_values(p_tags, 'e')) t
                       WHERE buzz.is_hex64(t) ORDER BY t);
  a record;
  target text;
BEGIN
  FOREACH target IN ARRAY ids LOOP
    PERFORM pg_advisory_xact_lock(hashtextextended('event:' || target, 0));  -- see accept_event
  END LOOP;
  FOR a IN SELECT * FROM buzz.deletion_addresses(author, p_tags) LOOP
    PERFORM pg_advisory_xact_lock(hashtextextended(a.lock_key, 0));          -- see accept_event
  END LOOP;

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
  'NIP-09: deletes the author''s own versions of a-tag addresses up to the request''s created_at and events named by e tags (leaving tombstones); cancels affected reminders. Takes every lock first, in acceptance''s order (ids, then addresses, each sorted and taken once), then touches rows.';
