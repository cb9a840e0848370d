-- Back to one logical message per confirmed reminder (0004's definition).

CREATE OR REPLACE FUNCTION buzz.confirm_reminder_claims(p_ids text[], p_stamps bigint[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
  flipped text[];
  emitted text[];
BEGIN
  IF coalesce(array_length(p_ids, 1), 0) <> coalesce(array_length(p_stamps, 1), 0) THEN
    RAISE EXCEPTION 'confirm_reminder_claims: % ids but % stamps',
      coalesce(array_length(p_ids, 1), 0), coalesce(array_length(p_stamps, 1), 0);
  END IF;
  -- One set-based statement: flip the rows still claimed under the given stamps (the fence) and
  -- emit one due message for each. Rows are locked in the order the planner visits them; callers
  -- pass ids sorted. The only overlap between two batches is a stale claimer and its recoverer;
  -- should they deadlock, one gets 40P01 and, being a plain error, emits nothing.
  WITH c AS (
    UPDATE buzz.reminders x
       SET state = 'confirmed', confirmed_at = clock_timestamp(), lease_until = NULL
      FROM unnest(p_ids, p_stamps) AS u(id, stamp)
     WHERE x.id = u.id AND x.stamp = u.stamp AND x.state = 'claimed'
    RETURNING x.id, x.stamp
  ), m AS (
    SELECT c.id, pg_logical_emit_message(true, 'buzz', jsonb_build_object(
             't', 'due',
             'ev', jsonb_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                                      'tags', e.tags, 'content', e.content, 'sig', e.sig),
             'stamp', c.stamp, 'scope', 'a')::text) AS lsn
      FROM c JOIN buzz.events e ON e.id = c.id
  )
  SELECT (SELECT array_agg(c.id) FROM c), (SELECT array_agg(m.id) FROM m WHERE m.lsn IS NOT NULL)
    INTO flipped, emitted;
  -- A flipped row whose stored version is gone (removed by hand) had nothing to deliver.
  IF coalesce(array_length(flipped, 1), 0) > coalesce(array_length(emitted, 1), 0) THEN
    UPDATE buzz.reminders SET state = 'cancelled', cancelled_at = now(), confirmed_at = NULL
     WHERE id = ANY (flipped) AND NOT (id = ANY (coalesce(emitted, '{}')));
  END IF;
  RETURN QUERY SELECT unnest(coalesce(emitted, '{}'));
END $$;
COMMENT ON FUNCTION buzz.confirm_reminder_claims(text[], bigint[]) IS
  'Batch confirm_reminder_claim: for each (id, stamp) pair still claimed under that stamp, emits the due signal '
  'and marks it confirmed, all in the caller''s transaction; returns the confirmed ids. Pairs with a stale stamp '
  'emit nothing.';
