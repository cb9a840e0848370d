-- Back to the LANGUAGE sql definitions of 0002-0004.

CREATE OR REPLACE FUNCTION buzz.cfg(k text) RETURNS text
LANGUAGE sql STABLE AS $$ SELECT value FROM buzz.config WHERE key = k $$;

CREATE OR REPLACE FUNCTION buzz.tag_values(tags jsonb, name text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(t->>1 ORDER BY n), '{}') FROM jsonb_array_elements(tags) WITH ORDINALITY AS x(t, n)
  WHERE t->>0 = name AND jsonb_array_length(t) >= 2
$$;

CREATE OR REPLACE FUNCTION buzz.event_tagvals(tags jsonb) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT coalesce(array_agg(DISTINCT (t->>0) || ':' || (t->>1)), '{}') FROM jsonb_array_elements(tags) t
  WHERE length(t->>0) = 1 AND jsonb_array_length(t) >= 2
$$;

CREATE OR REPLACE FUNCTION buzz.visibility_source(viewer text,
                                       OUT generation bigint, OUT hidden uuid[], OUT created_at_floor bigint)
LANGUAGE sql STABLE AS $$
  SELECT coalesce(s.target_generation, 0),
         coalesce((SELECT array_agg(m.channel_id ORDER BY m.channel_id) FROM buzz.members m
                    WHERE m.pubkey = $1 AND m.hidden_at IS NOT NULL), '{}'),
         -- Every author of the address counts (relay key rotation), and so does what we recorded
         -- as published (an operator may have deleted the head row; clients may still hold it).
         coalesce(greatest((SELECT max(e.created_at) FROM buzz.events e
                             WHERE e.kind = 30622 AND e.d_tag = $1),
                           s.published_created_at), 0)
    FROM (SELECT 1) one
    LEFT JOIN buzz.visibility_state s ON s.viewer = $1
$$;

CREATE OR REPLACE FUNCTION buzz.claim_visibility_work(p_claim uuid, p_max integer, p_lease interval)
RETURNS TABLE (viewer text, generation bigint, attempts integer, pending_seconds double precision)
LANGUAGE sql AS $$
  -- A claim lost in a crash is harmless (the row is simply claimable again), so its commit does
  -- not wait for the WAL flush: one fsync less on the path from a change to its snapshot.
  SELECT set_config('synchronous_commit', 'off', true);
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
    FROM (SELECT viewer FROM fresh UNION ALL SELECT viewer FROM failing) c
   WHERE o.viewer = c.viewer
  RETURNING o.viewer, o.generation, o.attempts, extract(epoch FROM now() - o.enqueued_at)::double precision
$$;

CREATE OR REPLACE FUNCTION buzz.reminder_event_json(p_id text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
  SELECT jsonb_build_object('id', e.id, 'pubkey', e.pubkey, 'created_at', e.created_at, 'kind', e.kind,
                            'tags', e.tags, 'content', e.content, 'sig', e.sig)
    FROM buzz.events e WHERE e.id = p_id
$$;

ALTER FUNCTION buzz.now_unix() STABLE;
