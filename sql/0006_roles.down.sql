-- The roles stay: other databases of the cluster may use them.
DO $$
DECLARE
  f regprocedure;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
            WHERE p.proname = 'pg_logical_emit_message'
              AND p.pronamespace = 'pg_catalog'::regnamespace
              AND pg_catalog.pg_has_role(p.proowner, 'USAGE') LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM buzz_relay', f);
  END LOOP;
END $$;
ALTER DEFAULT PRIVILEGES IN SCHEMA buzz REVOKE SELECT ON TABLES FROM buzz_operator;
REVOKE ALL ON ALL TABLES IN SCHEMA buzz FROM buzz_relay, buzz_operator;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA buzz FROM buzz_relay, buzz_operator;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA buzz FROM buzz_relay, buzz_operator;
DROP VIEW buzz.buzz_schema_migrations;
REVOKE SELECT ON buzz_schema_migrations FROM buzz_relay, buzz_operator;
REVOKE USAGE ON SCHEMA buzz FROM buzz_relay, buzz_operator;
