-- buzzpg schema: the event store, channels/DMs, per-viewer visibility state and its outbox,
-- reminders, and process bookkeeping. Functions live in the later migrations, one file per area
-- (0002_accept, 0003_visibility, 0004_reminders, 0005_fanout); roles and grants in 0006_roles.
--
-- Lock order (every function follows it, so concurrent transactions cannot deadlock on each other
-- except through retries Go performs on 40P01/40001):
--   1. buzz.channels row (FOR SHARE / FOR UPDATE)
--   2. buzz.members rows of that channel, ORDER BY pubkey FOR UPDATE
--   3. buzz.visibility_state rows, by viewer
--   4. buzz.visibility_outbox rows, by viewer
-- Address (replaceable/addressable) writers additionally take a transaction advisory lock on the
-- address before touching buzz.events.

CREATE SCHEMA IF NOT EXISTS buzz;

-- Deployment-wide settings the SQL side needs (the relay key's pubkey, limits). Written by
-- `buzzpg serve` at start; readable by operators.
CREATE TABLE buzz.config (
  key   text PRIMARY KEY,
  value text NOT NULL
);
INSERT INTO buzz.config(key, value) VALUES
  ('relay_pubkey', ''),                       -- hex pubkey of the relay key; set by serve
  ('max_future_seconds', '900'),              -- created_at may be at most this far ahead of now
  ('reminder_horizon_seconds', '31536000'),   -- not_before may be at most this far ahead (1 year)
  ('snapshot_max_ahead_seconds', '10'),       -- snapshot created_at at most this far ahead of db now
  ('reminder_lease_seconds', '30');           -- default lease of a reminder claim

-- Ids, pubkeys, viewers and d, h and tag values are COLLATE "C" in every table: byte order, the
-- same in any database whatever its locale, and B-tree comparisons by memcmp instead of the
-- locale's strcoll (PostgreSQL CPU per stored event, docs/benchmarks.md). One collation for all of
-- them: a comparison between two different ones could not use either column's index.

-- Every stored event. Ephemeral events never land here.
-- scope/scope_p/channel_id are the read gate (docs/protocol.md, Read gates), computed by accept_event:
--   '*' everyone, 'a' author only, 'p' only scope_p, 'c' only members of channel_id.
CREATE TABLE buzz.events (
  id          text COLLATE "C" PRIMARY KEY CHECK (length(id) = 64 AND id ~ '^[0-9a-f]+$'),
  pubkey      text COLLATE "C" NOT NULL CHECK (length(pubkey) = 64 AND pubkey ~ '^[0-9a-f]+$'),
  created_at  bigint  NOT NULL,
  kind        integer NOT NULL CHECK (kind >= 0 AND kind <= 65535),
  tags        jsonb   NOT NULL,
  content     text    NOT NULL,
  sig         text    NOT NULL,
  received_at timestamptz NOT NULL DEFAULT now(),
  d_tag       text COLLATE "C",                -- addressable events' d value ('' when absent)
  tagvals     text[]  NOT NULL DEFAULT '{}', -- 'x:value' for every single-letter tag; buzz.event_tags indexes them
  h           text COLLATE "C",                -- first h tag value (channel id), for channel history scans
  expires_at  bigint,              -- NIP-40 expiration (unix seconds) or NULL
  scope       "char"  NOT NULL DEFAULT '*' CHECK (scope IN ('*','a','p','c')),
  scope_p     text COLLATE "C",
  channel_id  uuid
);
-- pgoutput must send whole rows (we decode inserts only, but deletes need the key).
ALTER TABLE buzz.events REPLICA IDENTITY DEFAULT;

CREATE INDEX events_created_idx      ON buzz.events (created_at DESC, id);
CREATE INDEX events_pubkey_idx       ON buzz.events (pubkey, created_at DESC, id);
CREATE INDEX events_kind_idx         ON buzz.events (kind, created_at DESC, id);
CREATE INDEX events_pubkey_kind_idx  ON buzz.events (pubkey, kind, created_at DESC, id);
CREATE INDEX events_h_idx            ON buzz.events (h, created_at DESC, id) WHERE h IS NOT NULL;
CREATE INDEX events_expires_idx      ON buzz.events (expires_at) WHERE expires_at IS NOT NULL;
-- One head per replaceable/addressable address: the backstop behind accept_event's address lock.
CREATE UNIQUE INDEX events_replaceable_head ON buzz.events (pubkey, kind)
  WHERE kind IN (0, 3) OR (kind >= 10000 AND kind < 20000);
CREATE UNIQUE INDEX events_addressable_head ON buzz.events (kind, pubkey, d_tag)
  WHERE kind >= 30000 AND kind < 40000;
-- Snapshots (30622) are looked up by viewer across relay keys (key rotation).
CREATE INDEX events_snapshot_viewer_idx ON buzz.events (d_tag, created_at DESC) WHERE kind = 30622;

-- The #x filter index: one row per 'x:value' key of an event (buzz.events.tagvals), kept by the
-- triggers of 0002_accept (events_tags_*), so every writer of buzz.events keeps it. A B-tree in
-- the REQ's order: `{"#t":["v"],"limit":100}` walks the key's newest 100 entries and joins them
-- to buzz.events on (id, created_at), where a GIN index on tagvals found every matching row and
-- sorted them (docs/benchmarks.md). event_id has buzz.events.id's collation: a join on both
-- columns then hands the index order to ORDER BY created_at DESC, id. No foreign key: the delete
-- trigger removes an event's rows, which an RI check per deleted event would only re-check.
CREATE TABLE buzz.event_tags (
  tagval     text COLLATE "C" NOT NULL,
  created_at bigint NOT NULL,
  event_id   text COLLATE "C" NOT NULL
);
CREATE UNIQUE INDEX event_tags_idx ON buzz.event_tags (tagval, created_at DESC, event_id);
COMMENT ON TABLE buzz.event_tags IS
  'One row per ''x:value'' key (buzz.events.tagvals) of every stored event, kept by triggers on buzz.events: what #x filters walk, newest first.';

-- NIP-09 tombstones: a deleted id stays deleted when published again (by its author). Keyed by
-- (id, deleter): a kind 5 naming someone else's id (accepted; it deletes nothing) must not take
-- the slot of the author's own tombstone. accept_event honours the author's one only.
CREATE TABLE buzz.deleted_ids (
  id          text COLLATE "C" NOT NULL,
  pubkey      text COLLATE "C" NOT NULL,          -- author of the deletion request (only the author may delete)
  deleted_by  text COLLATE "C" NOT NULL,          -- id of the kind 5 event
  deleted_at  timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (id, pubkey)
);
-- NIP-09 'a' deletions: versions of the address up to until_created_at are deleted.
CREATE TABLE buzz.deleted_addresses (
  kind             integer NOT NULL,
  pubkey           text COLLATE "C" NOT NULL,
  d_tag            text COLLATE "C" NOT NULL,
  until_created_at bigint  NOT NULL,
  PRIMARY KEY (kind, pubkey, d_tag)
);

-- Channels. Every channel in this version is a DM whose participant set never changes; its
-- identity (participant_hash) is the SHA-256 of the sorted, de-duplicated 32-byte participant
-- pubkeys.
CREATE TABLE buzz.channels (
  id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
  kind             text NOT NULL DEFAULT 'dm' CHECK (kind = 'dm'),
  participant_hash bytea NOT NULL UNIQUE,
  created_by       text COLLATE "C" NOT NULL,
  created_event    text COLLATE "C",
  created_at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE buzz.members (
  channel_id uuid NOT NULL REFERENCES buzz.channels(id) ON DELETE CASCADE,
  pubkey     text COLLATE "C" NOT NULL CHECK (length(pubkey) = 64 AND pubkey ~ '^[0-9a-f]+$'),
  joined_at  timestamptz NOT NULL DEFAULT now(),
  hidden_at  timestamptz,             -- NULL: visible to this member; set: hidden by this member
  PRIMARY KEY (channel_id, pubkey)
);
CREATE INDEX members_pubkey_idx ON buzz.members (pubkey);
CREATE INDEX members_hidden_idx ON buzz.members (pubkey, channel_id) WHERE hidden_at IS NOT NULL;

-- Per-viewer visibility state: the truth. target > published means a snapshot is owed.
CREATE TABLE buzz.visibility_state (
  viewer               text COLLATE "C" PRIMARY KEY CHECK (length(viewer) = 64 AND viewer ~ '^[0-9a-f]+$'),
  target_generation    bigint NOT NULL DEFAULT 0,
  published_generation bigint NOT NULL DEFAULT 0,
  published_created_at bigint,          -- created_at of the published 30622 head
  published_event      text COLLATE "C",            -- id of the published 30622 head
  changed_at           timestamptz NOT NULL DEFAULT now(),
  published_at         timestamptz,
  -- A publisher that read a viewer before a reset must not publish over the restarted row: its
  -- publication fails here (23514, this name), which the listener takes as 'retry'. A
  -- constraint holds for every writer, psql included.
  CONSTRAINT visibility_state_published_le_target CHECK (published_generation <= target_generation)
)
-- Hot: updated by every hide and resurfacing message and every publication. No update is HOT
-- (each moves a generation, a column of visibility_pending_idx's predicate), so free space on the
-- page buys nothing: fillfactor 70 measured the same size as 100. What bounds it is vacuum: after
-- 2% of its rows died rather than 20% (100,000 viewers: 2,000, not 20,000 dead versions and their
-- index entries), without cost pauses. docs/benchmarks.md, Upkeep.
WITH (fillfactor = 100, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
      autovacuum_vacuum_cost_delay = 0);
CREATE INDEX visibility_pending_idx ON buzz.visibility_state (viewer)
  WHERE target_generation > published_generation;

-- The work queue: at most one row per viewer, upserted with the generation it must reach.
-- Claimed with a lease (claim_id, lease_until); failures back off via available_at. A row
-- follows its viewer's state row: deleting the state row (a reset) takes the outbox row with it,
-- so no row is left behind that every publication answers 'stale' without clearing.
CREATE TABLE buzz.visibility_outbox (
  viewer       text COLLATE "C" PRIMARY KEY,
  generation   bigint NOT NULL,
  enqueued_at  timestamptz NOT NULL DEFAULT now(),
  available_at timestamptz NOT NULL DEFAULT now(),
  attempts     integer NOT NULL DEFAULT 0,
  last_error   text,
  claim_id     uuid,
  lease_until  timestamptz,
  CONSTRAINT visibility_outbox_viewer_fkey FOREIGN KEY (viewer)
    REFERENCES buzz.visibility_state (viewer) ON DELETE CASCADE,
  -- A claim is recovered only once its lease is behind the clock, which a NULL lease never is.
  CONSTRAINT claimed_outbox_row_needs_lease CHECK (claim_id IS NULL OR lease_until IS NOT NULL)
)
-- A queue: rows live for milliseconds, claimed then deleted. Claims are HOT already (99% at
-- fillfactor 100); fillfactor 50 only spread the few live rows over more pages (heap 600-900 kB
-- against 40-56 kB). Dead rows outnumber live ones, so vacuum comes on an absolute count, not a
-- share of the (near zero) live rows, and without cost pauses. docs/benchmarks.md, Upkeep.
WITH (fillfactor = 100, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 100,
      autovacuum_vacuum_cost_delay = 0);
CREATE INDEX visibility_outbox_available_idx ON buzz.visibility_outbox (available_at);

-- The highest generation of every viewer whose state row was deleted (a reset) or truncated. A
-- row inserted for that viewer later starts above it (0003_visibility's triggers), so generation
-- numbers never repeat. One row per viewer ever reset.
CREATE TABLE buzz.visibility_retired (
  viewer     text COLLATE "C" PRIMARY KEY,
  generation bigint NOT NULL
);
COMMENT ON TABLE buzz.visibility_retired IS
  'The highest generation of every viewer whose visibility_state row was deleted (or truncated): a row inserted for that viewer later starts above it, so generation numbers never repeat. Kept for good: an UPDATE that lowers a generation or changes a viewer, a DELETE and a TRUNCATE are refused with BZ400.';

-- Viewers a TRUNCATE statement must bump once its tables are gone: filled by the BEFORE TRUNCATE
-- triggers of members (had a DM hidden) and visibility_state (had a change pending), bumped and
-- emptied by the first AFTER TRUNCATE trigger of the same statement.
CREATE TABLE buzz.visibility_reset_pending (
  viewer text COLLATE "C" PRIMARY KEY
);
COMMENT ON TABLE buzz.visibility_reset_pending IS
  'Viewers to bump once a TRUNCATE of buzz.members or buzz.visibility_state is done: filled by their BEFORE TRUNCATE triggers, emptied by the first AFTER TRUNCATE trigger of the same statement. Empty otherwise.';

-- NIP-ER reminders: one row per reminder version (event id) that carries not_before.
-- state: 'armed' (waiting for not_before), 'claimed' (a scheduler holds it under stamp until
-- lease_until), 'confirmed' (due signal emitted), 'cancelled' (superseded, deleted or expired).
CREATE SEQUENCE buzz.reminder_stamp_seq;
CREATE TABLE buzz.reminders (
  id            text COLLATE "C" PRIMARY KEY,     -- the 30300 event id (one version)
  pubkey        text COLLATE "C" NOT NULL,
  d_tag         text COLLATE "C" NOT NULL,
  created_at    bigint NOT NULL,
  not_before    bigint NOT NULL,
  expires_at    bigint,
  state         text   NOT NULL DEFAULT 'armed'
                CHECK (state IN ('armed','claimed','confirmed','cancelled')),
  stamp         bigint,
  claimed_at    timestamptz,
  lease_until   timestamptz,
  confirmed_at  timestamptz,
  cancelled_at  timestamptz,
  claims        integer NOT NULL DEFAULT 0,  -- how many times it was claimed
  recoveries    integer NOT NULL DEFAULT 0,  -- how many expired leases were re-taken
  rollbacks     integer NOT NULL DEFAULT 0,
  -- A claim is recovered only once its lease is behind the clock, which a NULL lease never is.
  CONSTRAINT claimed_reminder_needs_lease CHECK (state <> 'claimed' OR lease_until IS NOT NULL)
)
-- Each row is updated twice (claim, confirm), both changing state, a column of the partial
-- indexes' predicates, so never HOT: fillfactor 80 made the heap larger, not the updates HOT.
-- Settled rows are purged (0007_upkeep); vacuum after 5% dead rows (default 20%) lets new rows
-- reuse the space the purge frees before the table grows. docs/benchmarks.md, Upkeep.
WITH (fillfactor = 100, autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_threshold = 500);
CREATE INDEX reminders_due_idx ON buzz.reminders (not_before) WHERE state = 'armed';
CREATE INDEX reminders_lease_idx ON buzz.reminders (lease_until) WHERE state = 'claimed';
-- Only versions that can still fire: every lookup by address asks for armed or claimed. The
-- index does not grow with the confirmed history, and a confirm writes no entry to it.
CREATE INDEX reminders_address_idx ON buzz.reminders (pubkey, d_tag) WHERE state IN ('armed', 'claimed');

-- Relay processes: heartbeat rows, used to drop replication slots of dead instances.
CREATE TABLE buzz.instances (
  instance_id  text PRIMARY KEY,
  slot_name    text NOT NULL,
  started_at   timestamptz NOT NULL DEFAULT now(),
  heartbeat_at timestamptz NOT NULL DEFAULT now(),
  listen_addr  text
)
-- A row per process, updated by every heartbeat. Heartbeats are HOT (heartbeat_at is in no index;
-- 100% measured at fillfactor 100), and page pruning reclaims the old versions: defaults suffice.
-- Stated so that nobody lowers it expecting a gain. docs/benchmarks.md, Upkeep.
WITH (fillfactor = 100);

-- The publication logical replication tails for fan-out.
CREATE PUBLICATION buzz_events FOR TABLE buzz.events WITH (publish = 'insert');
