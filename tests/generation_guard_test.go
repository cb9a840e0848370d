package tests

// I3 (a publisher holding generation g never overwrites a snapshot above g) compares numbers, so it
// holds only while a generation number names one state of a viewer. 0011 keeps them unique across
// a reset (DELETE of the state row); these operator writes would re-issue numbers a publisher may
// still hold, and 0024 refuses each with BZ400, changing nothing. buzzpg's own writes (bump,
// fenced publication, reset, the retire upsert that keeps the maximum) go on as before.

import (
	"testing"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func TestOperatorGenerationWritesRefused(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	relaySK, relayPK := testenv.NewKey()
	snapExec(t, pool, `UPDATE buzz.config SET value = $1 WHERE key = 'relay_pubkey'`, relayPK)
	hide := func(viewer, ch string, h bool) {
		snapExec(t, pool, `SELECT buzz.set_dm_hidden($1, $2::uuid, $3)`, viewer, ch, h)
	}
	publish := func(viewer string) {
		t.Helper()
		g, ev := opinSnapshot(t, pool, relaySK, viewer)
		if got := testenv.MustScalar[string](t, pool, `SELECT buzz.publish_visibility_snapshot($1, $2, $3::jsonb)`, viewer, g, ev); got != "published" {
			t.Fatalf("publish %.8s at %d: %s", viewer, g, got)
		}
	}
	gens := func(viewer string) [2]int64 {
		t.Helper()
		target, published := snapGens(t, pool, viewer)
		return [2]int64{target, published}
	}

	// v: published 1, pending at 2 (each refused UPDATE below would pass the CHECK of 0010).
	v, vch := snapSQLDM(t, pool)
	hide(v, vch, true)
	publish(v)
	hide(v, vch, false)
	// u: converged at 1 with no outbox row, so nothing but the guard stops a change of its viewer.
	u, uch := snapSQLDM(t, pool)
	hide(u, uch, true)
	publish(u)
	// w: converged at generation 2, then reset (nothing pending, so no row is made again, 0026);
	// its retired row is what the last cases aim at.
	w, wch := snapSQLDM(t, pool)
	hide(w, wch, true)
	hide(w, wch, false)
	publish(w)
	snapExec(t, pool, `DELETE FROM buzz.visibility_state WHERE viewer = $1`, w)
	if g := gens(v); g != [2]int64{2, 1} {
		t.Fatalf("v's generations %v, want target 2, published 1", g)
	}
	if g := testenv.MustInt(t, pool, `SELECT generation FROM buzz.visibility_retired WHERE viewer = $1`, w); g != 2 {
		t.Fatalf("w retired at %d, want 2", g)
	}
	_, fresh := testenv.NewKey()

	const resetHint = "to reset a viewer, DELETE its visibility_state row"
	cases := []struct {
		name string
		sql  string
		args []any
		want string
	}{
		{"lower the target", `UPDATE buzz.visibility_state SET target_generation = 1 WHERE viewer = $1`, []any{v}, "invalid: visibility generations never go down"},
		{"lower the published generation", `UPDATE buzz.visibility_state SET published_generation = 0 WHERE viewer = $1`, []any{v}, "invalid: visibility generations never go down"},
		{"reset both to 0 by UPDATE", `UPDATE buzz.visibility_state SET target_generation = 0, published_generation = 0 WHERE viewer = $1`, []any{v}, resetHint},
		{"move a row to another viewer", `UPDATE buzz.visibility_state SET viewer = $2 WHERE viewer = $1`, []any{u, fresh}, "invalid: a visibility_state row keeps its viewer"},
		{"lower a retired generation", `UPDATE buzz.visibility_retired SET generation = 1 WHERE viewer = $1`, []any{w}, "invalid: a retired generation only rises"},
		{"move a retired generation to another viewer", `UPDATE buzz.visibility_retired SET viewer = $2 WHERE viewer = $1`, []any{w, fresh}, "invalid: a retired generation only rises and keeps its viewer"},
		{"delete a retired generation", `DELETE FROM buzz.visibility_retired WHERE viewer = $1`, []any{w}, "invalid: rows of visibility_retired are kept for good"},
		{"truncate the retired generations", `TRUNCATE buzz.visibility_retired`, nil, resetHint},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			opinAssertRefused(t, pool, c.want, c.sql, c.args...)
		})
	}

	t.Run("bumps, publications and resets still work", func(t *testing.T) {
		hide(v, vch, true) // a bump: target 3
		publish(v)         // the fence raises published to 3
		if g := gens(v); g != [2]int64{3, 3} {
			t.Fatalf("after a bump and its publication: %v, want 3, 3", g)
		}
		// Columns other than the generations and the viewer stay the operator's to write.
		snapExec(t, pool, `UPDATE buzz.visibility_state SET changed_at = now() WHERE viewer = $1`, v)
		snapExec(t, pool, `DELETE FROM buzz.visibility_state WHERE viewer = $1`, v) // the reset
		hide(v, vch, false)                                                         // the next bump starts above 3
		if g := gens(v); g != [2]int64{4, 3} {
			t.Fatalf("after a reset and the next bump: %v, want target 4, published 3", g)
		}
		// Raising a retired generation repeats nothing; retire_generation keeps the maximum.
		snapExec(t, pool, `SELECT buzz.retire_generation($1, 1)`, w)
		snapExec(t, pool, `UPDATE buzz.visibility_retired SET generation = 5 WHERE viewer = $1`, w)
		hide(w, wch, true) // w's new row: published 5, target 6
		publish(w)
		// TRUNCATE retires every row through the upsert, raising v's and w's retired rows; v had a
		// change pending and is made pending again above its retired 4 (0026).
		snapExec(t, pool, `TRUNCATE buzz.visibility_state CASCADE`)
		retired := testenv.MustColumn[int64](t, pool, `SELECT generation FROM buzz.visibility_retired WHERE viewer = ANY($1) ORDER BY viewer = $2`,
			[]string{v, w}, w)
		if len(retired) != 2 || retired[0] != 4 || retired[1] != 6 {
			t.Fatalf("retired after TRUNCATE: v, w = %v, want 4, 6", retired)
		}
		if g := gens(v); g != [2]int64{5, 4} {
			t.Fatalf("v after TRUNCATE: %v, want target 5, published 4", g)
		}
		hide(w, wch, false)
		if g := gens(w); g != [2]int64{7, 6} {
			t.Fatalf("w after TRUNCATE and a bump: %v, want target 7, published 6", g)
		}
	})
}
