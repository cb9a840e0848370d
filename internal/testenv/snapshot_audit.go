package testenv

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// SnapshotAudit records every stored 30622 in public.snapshot_audit with the generation being
// published: the trigger runs inside publish_visibility_snapshot, after its fence UPDATE, so the
// state row holds that generation. Tests read it to check that generations and created_at rise.
func SnapshotAudit(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	const sql = `
		CREATE TABLE public.snapshot_audit (
		  seq bigserial PRIMARY KEY, viewer text, generation bigint, created_at bigint, pubkey text,
		  hidden text[], at timestamptz DEFAULT clock_timestamp());
		CREATE FUNCTION public.snapshot_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  INSERT INTO public.snapshot_audit (viewer, generation, created_at, pubkey, hidden)
		  SELECT NEW.d_tag, s.published_generation, NEW.created_at, NEW.pubkey,
		         coalesce((SELECT array_agg(t->>1 ORDER BY t->>1) FROM jsonb_array_elements(NEW.tags) t
		                    WHERE t->>0 = 'h'), '{}')
		    FROM buzz.visibility_state s WHERE s.viewer = NEW.d_tag;
		  RETURN NULL;
		END $$;
		CREATE TRIGGER snapshot_audit AFTER INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.snapshot_audit_fn();`
	if _, err := pool.Exec(context.Background(), sql); err != nil {
		t.Fatalf("snapshot audit: %v", err)
	}
}
