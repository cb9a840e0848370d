-- The roles buzz_relay and buzz_operator could EXECUTE the API but not use it.
--
-- 0001 created the two roles and later migrations granted them EXECUTE on accept_event and the
-- other entry points, "to the relay and operator roles only". But every function runs with its
-- caller's rights (SECURITY INVOKER), so a login role that was only a member of buzz_relay failed
-- on the first table a function touched ("permission denied for table config"), and serve could
-- not even read the migrations table to check the schema version. Only the schema owner (or a
-- superuser) could run a relay or call the functions from psql.
--
-- Both roles now get the table rights the functions and the relay's own reads need. The operator
-- role gets the same: the README's psql tour has operators UPDATE member rows (a raw hide
-- converges through the triggers), retry an outbox row and reset a viewer by DELETE. Default
-- privileges extend this to tables and sequences later migrations create (migrations run as the
-- owner that runs this one).
--
-- What else a relay's login role needs is outside the database's grants: the REPLICATION
-- attribute (its slot, the stream, dropping stale peers' slots) and a pg_hba.conf line for
-- replication connections. Migrations still need the owner.

GRANT SELECT ON buzz_schema_migrations TO buzz_relay, buzz_operator;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA buzz TO buzz_relay, buzz_operator;
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA buzz TO buzz_relay, buzz_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO buzz_relay, buzz_operator;
-- Rows of visibility_retired must never be deleted (0011: generations would repeat); its trigger
-- only inserts and raises them.
REVOKE DELETE ON buzz.visibility_retired FROM buzz_relay, buzz_operator;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz
  GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO buzz_relay, buzz_operator;
