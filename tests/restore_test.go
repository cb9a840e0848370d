package tests

// The restore drill: a backup taken with pg_dump while a relay serves, restored into a fresh
// cluster, picked up by a new `buzzpg serve` where the backup left off (docs/operations.md, Backup
// and restore, lists the steps this test takes).
//
// The backup is taken while the old server owes work of every kind: viewers owed a snapshot
// (outbox rows unclaimed, and claimed by a process that died), reminders confirmed, armed for
// later, due and unclaimed, claimed by the old server's scheduler (held at a hook), and claimed
// by a process that died. After the restore every viewer converges to its hidden set, every
// reminder not confirmed in the backup is delivered exactly once, none confirmed in the backup
// fires again, and the replication slot is created afresh (a dump never carries one).
//
// What the old server delivered after the backup was taken is delivered again after the restore:
// the backup says those reminders are not confirmed, and the database is the only record.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

const (
	drillInstance = "restoredrill" // the same instance id before and after: slot buzz_restoredrill
	drillRole     = "drill_relay"  // the relay's login, a member of buzz_relay
	drillDB       = "buzzpg"       // the database scripts/pg.sh creates on both clusters
)

type drill struct {
	t        *testing.T
	bin      string // PostgreSQL's client programs
	dir      string // the backup's files
	key      string // the relay key, the same before and after
	old, new *testenv.Cluster
	oldPool  *pgxpool.Pool
	newPool  *pgxpool.Pool
	hooksOld string
	oldRelay *testenv.Relay
	newRelay *testenv.Relay

	dms             *drillDMs
	u, noise        []testenv.User // tracked viewers; viewers changing while pg_dump runs
	ring            []string       // ring[i]: the DM of u[i] and u[i+1]
	group           string         // the DM of u[0..3]
	partner, author testenv.User
	dueOld, dueNew  *testenv.Sub // the author's due signals on each server

	rem        map[string]*nostr.Event // reminders by name
	duringDump []*nostr.Event          // reminders stored while pg_dump ran
	claimed    []string                // viewers owed a snapshot whose outbox row a dead process holds
	pending    []string                // viewers owed a snapshot, outbox row unclaimed
	backup     map[string]string       // reminder id -> state in the backup
	lost       map[string]int64        // viewer -> created_at the old server published after the backup
	atBackup   map[string]int          // due signals the author had received on the old server by then
}

func TestRestoreDrill(t *testing.T) {
	t0 := time.Now()
	d := drillStart(t)
	var took []string
	for _, step := range []struct {
		name string
		run  func()
	}{
		{"settle", d.settle}, {"hold", d.holdOld}, {"owe", d.oweWork}, {"backup", d.takeBackup},
		{"after backup", d.afterBackup}, {"restore", d.restore}, {"serve", d.serveRestored},
		{"reminders", d.checkReminders}, {"viewers", d.checkViewers}, {"slot", d.checkSlot},
		{"republish", d.republishAll},
	} {
		t1 := time.Now()
		step.run()
		took = append(took, fmt.Sprintf("%s %s", step.name, time.Since(t1).Round(10*time.Millisecond)))
	}
	t.Logf("restore drill: %s (%s)", time.Since(t0).Round(time.Millisecond), strings.Join(took, ", "))
}

// drillEnv: both servers run as the relay's login (which may not migrate), and their periodic
// visibility sweep is an hour away, so only the sweep a publisher runs when its LISTEN connects
// finds work nobody notified (the guard this drill checks after the restore).
func drillEnv(more map[string]string) map[string]string {
	env := map[string]string{"BUZZ_AUTO_MIGRATE": "false", "BUZZ_SWEEP_INTERVAL": "1h"}
	for k, v := range more {
		env[k] = v
	}
	return env
}

// drillStart starts the old cluster, migrates it as the schema owner, creates the relay's login
// and starts the old server with two hooks: reminder.after_claim (passing until holdOld arms it)
// and visibility.listen_reconnect (reached only once holdOld cuts the LISTEN connection).
func drillStart(t *testing.T) *drill {
	d := &drill{t: t, bin: drillBinDir(t), dir: t.TempDir(), rem: map[string]*nostr.Event{}}
	d.key, _ = testenv.NewKey()
	d.old = testenv.PrivateCluster(t, "restore-drill-old")
	owner := d.old.MigratedURL(t)
	d.oldPool = testenv.Pool(t, owner)
	snapExec(t, d.oldPool, `CREATE ROLE `+drillRole+` LOGIN REPLICATION IN ROLE buzz_relay`)
	d.hooksOld = t.TempDir()
	hooks.Release(t, d.hooksOld, "reminder.after_claim")
	d.oldRelay = testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: testenv.AsRole(t, owner, drillRole), RelayKey: d.key,
		InstanceID: drillInstance, Env: drillEnv(map[string]string{"BUZZ_REMINDER_LEASE": "3s"}),
		HookDir: d.hooksOld, Hooks: []string{"reminder.after_claim", "visibility.listen_reconnect"}})

	for i := 0; i < 6; i++ {
		d.u = append(d.u, testenv.NewUser())
	}
	for i := 0; i < 4; i++ {
		d.noise = append(d.noise, testenv.NewUser())
	}
	d.partner, d.author = testenv.NewUser(), testenv.NewUser()
	c := testenv.Dial(t, d.oldRelay.URL)
	for _, u := range append(append(slices.Clone(d.u), d.noise...), d.partner, d.author) {
		c.Auth(u.SK)
	}
	d.dms = newDrillDMs(t, c)
	d.dueOld = remDueSub(t, d.oldRelay.URL, d.author.SK, d.author.PK)
	return d
}

// settle: hides, re-opens and resurfacing, two reminders delivered and confirmed, and every
// snapshot published, all before the old server is held.
func (d *drill) settle() {
	t, m, u := d.t, d.dms, d.u
	for i := range u {
		d.ring = append(d.ring, m.open(u[i], u[(i+1)%len(u)]))
	}
	d.group = m.open(u[0], u[1], u[2], u[3])
	ch, g := d.ring, d.group
	for i, n := range d.noise {
		m.hide(n, m.open(n, d.partner))
		if i%2 == 1 {
			m.open(n, d.partner)
		}
	}
	m.hide(u[1], ch[0])
	m.hide(u[1], ch[1])
	m.hide(u[2], ch[1])
	m.hide(u[3], g)
	m.hide(u[0], g)
	m.say(u[0], g) // resurfaces g for u[3]; u[0]'s own hide stays
	m.hide(u[4], ch[3])
	m.hide(u[5], ch[5])
	m.hide(u[5], ch[4])
	d.dms.open(u[5], u[4]) // re-opens ch[4] for u[5]

	now := time.Now().Unix()
	for _, name := range []string{"conf1", "conf2"} {
		d.rem[name] = remEvent(t, d.author.SK, now, name, remNB(now-1))
		m.c.MustPublish(d.rem[name])
	}
	d.dueOld.WaitEvents(30*time.Second, d.rem["conf1"].ID, d.rem["conf2"].ID)
	drillConverged(t, d.oldPool, d.viewers(), 30*time.Second)
	d.checkModel(d.oldPool)
}

// viewers are the drill's viewers that have a hidden-set history.
func (d *drill) viewers() []string {
	var vs []string
	for _, u := range append(slices.Clone(d.u), d.noise...) {
		vs = append(vs, u.PK)
	}
	return vs
}

// checkModel: each tracked viewer's head on pool is the hidden set the model holds.
func (d *drill) checkModel(pool *pgxpool.Pool) {
	d.t.Helper()
	for i, u := range d.u {
		if hs, _, _ := drillHead(d.t, pool, u.PK); !slices.Equal(hs, d.dms.want(u.PK)) {
			d.t.Errorf("viewer u%d: snapshot hides %v, want %v", i, hs, d.dms.want(u.PK))
		}
	}
}

// holdOld stops the old server's scheduler at reminder.after_claim holding its claim of "held",
// and cuts its visibility LISTEN connection, whose reconnect waits at its hook: from now on
// nothing wakes its publisher, so every change stays owed.
func (d *drill) holdOld() {
	t := d.t
	drillRearm(t, d.hooksOld, "reminder.after_claim")
	now := time.Now().Unix()
	d.rem["held"] = remEvent(t, d.author.SK, now, "held", remNB(now-1))
	d.dms.c.MustPublish(d.rem["held"])
	hooks.Wait(t, d.hooksOld, "reminder.after_claim", 30*time.Second)
	if r := remGet(t, d.oldPool, d.rem["held"].ID); r.State != "claimed" {
		t.Fatalf("the old scheduler at its hook: reminder %s, want claimed", r.State)
	}
	n := testenv.MustInt(t, d.oldPool, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name LIKE 'buzzpg-visibility-listen:%'`)
	if n != 1 {
		t.Fatalf("terminated %d visibility LISTEN connections, want 1", n)
	}
	hooks.Wait(t, d.hooksOld, "visibility.listen_reconnect", 30*time.Second)
}

// oweWork makes the old server owe: two viewers' outbox rows claimed by a process that then died
// (from SQL, lease 4 s), four viewers' rows unclaimed, reminders due and unclaimed, due and
// claimed by a dead process (lease 3 s), and armed for a few seconds later.
func (d *drill) oweWork() {
	t, m, u := d.t, d.dms, d.u
	m.open(u[1], u[0]) // re-opens ring 0 for u1
	m.hide(u[4], d.ring[4])
	d.claimed = testenv.MustColumn[string](t, d.oldPool,
		`SELECT viewer FROM buzz.claim_visibility_work(gen_random_uuid(), 100, '4 seconds') ORDER BY viewer`)
	if want := drillSorted(u[1].PK, u[4].PK); !slices.Equal(d.claimed, want) {
		t.Fatalf("claimed %v, want u1 and u4", d.claimed)
	}

	m.hide(u[2], d.group)
	m.hide(u[3], d.ring[3])
	m.say(u[0], d.ring[5]) // resurfaces ring 5 for u5
	m.hide(u[0], d.ring[0])
	m.open(u[0], u[1]) // hidden and re-opened: owed a snapshot of the set it has
	d.pending = drillSorted(u[0].PK, u[2].PK, u[3].PK, u[5].PK)

	now := time.Now().Unix()
	for name, nb := range map[string]int64{"due": now - 1, "sqlclaim": now - 1, "future": now + 6} {
		d.rem[name] = remEvent(t, d.author.SK, now, name, remNB(nb))
		m.c.MustPublish(d.rem[name])
	}
	if remClaimLease(t, d.oldPool, d.rem["sqlclaim"], 3*time.Second) == nil {
		t.Fatal("the SQL claim of sqlclaim lost")
	}
}

func drillSorted(s ...string) []string { slices.Sort(s); return s }

// takeBackup saves the cluster's roles and takes pg_dump (custom format) of the relay's database
// while noise viewers hide and re-open and reminders are stored.
func (d *drill) takeBackup() {
	t := d.t
	drillRun(t, nil, filepath.Join(d.bin, "pg_dumpall"), drillConn(d.old, "--roles-only", "-f", d.path("roles.sql"))...)
	cmd := exec.Command(filepath.Join(d.bin, "pg_dump"), drillConn(d.old, "-d", drillDB, "-Fc", "-f", d.path("buzzpg.dump"))...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	for i, running := 0, true; running; i++ {
		n := d.noise[i%len(d.noise)]
		ch := d.dms.open(n, d.partner)
		if i%3 != 2 {
			d.dms.hide(n, ch)
		}
		now := time.Now().Unix()
		ev := remEvent(t, d.author.SK, now, fmt.Sprint("during", i), remNB(now-1))
		d.dms.c.MustPublish(ev)
		d.duringDump = append(d.duringDump, ev)
		select {
		case err = <-done:
			running = false
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err != nil {
		t.Fatalf("pg_dump: %v\n%s", err, out.String())
	}
	d.atBackup = d.dueOld.Counts()
	fi, _ := os.Stat(d.path("buzzpg.dump"))
	t.Logf("pg_dump took %s (%d bytes) while %d reminders and their noise went in", time.Since(start).Round(time.Millisecond),
		fi.Size(), len(d.duringDump))
}

func (d *drill) path(name string) string { return filepath.Join(d.dir, name) }

// afterBackup lets the old server go on: it delivers what the backup holds as undelivered and
// publishes what it owed (the timeline the restore forgets), then it and its cluster stop.
func (d *drill) afterBackup() {
	t := d.t
	now := time.Now().Unix()
	d.rem["post"] = remEvent(t, d.author.SK, now, "post", remNB(now-1))
	d.dms.c.MustPublish(d.rem["post"])
	hooks.Release(t, d.hooksOld, "reminder.after_claim")
	hooks.Release(t, d.hooksOld, "visibility.listen_reconnect")
	ids := []string{d.rem["held"].ID, d.rem["due"].ID, d.rem["post"].ID}
	for _, ev := range d.duringDump {
		ids = append(ids, ev.ID)
	}
	d.dueOld.WaitEvents(30*time.Second, ids...)
	// What needs an expired lease re-taken (sqlclaim, the claimed viewers) is waited for without
	// failing here: the restored server's checks are the ones that count.
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) && (d.dueOld.Counts()[d.rem["sqlclaim"].ID] == 0 || !drillReadLag(t, d.oldPool).zero()) {
		time.Sleep(20 * time.Millisecond)
	}
	d.lost = map[string]int64{}
	for _, v := range d.viewers() {
		_, d.lost[v], _ = drillHead(t, d.oldPool, v)
	}
	t.Logf("delivered on the old server after the backup: %s", d.deliveredNames(d.dueOld, d.atBackup))
	d.oldRelay.Stop()
	d.oldPool.Close()
	if err := d.old.Stop(); err != nil {
		t.Fatal(err)
	}
}

// deliveredNames names the reminders that arrived on s beyond the counts of before.
func (d *drill) deliveredNames(s *testenv.Sub, before map[string]int) string {
	counts := s.Counts()
	var names []string
	for name, ev := range d.rem {
		if counts[ev.ID] > before[ev.ID] {
			names = append(names, name)
		}
	}
	n := 0
	for _, ev := range d.duringDump {
		if counts[ev.ID] > before[ev.ID] {
			n++
		}
	}
	slices.Sort(names)
	return fmt.Sprintf("%s and %d stored during the dump", strings.Join(names, ", "), n)
}

// restore: a fresh cluster; the roles first (they are cluster-wide, and the dump's GRANTs name
// them), then pg_restore --create, statistics, and `buzzpg migrate up` (a no-op at the same
// version, which brings an older backup up to the binary).
func (d *drill) restore() {
	t := d.t
	d.new = testenv.PrivateCluster(t, "restore-drill-new")
	admin := testenv.Pool(t, d.new.URL("postgres"))
	snapExec(t, admin, `DROP DATABASE `+drillDB) // the empty one pg.sh made: --create makes it from the dump
	out := drillRun(t, nil, filepath.Join(d.bin, "psql"), drillConn(d.new, "-d", "postgres", "-X", "-q", "-f", d.path("roles.sql"))...)
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "ERROR") && !strings.Contains(line, `role "postgres" already exists`) {
			t.Fatalf("restoring the roles: %s\n%s", line, out)
		}
	}
	drillRun(t, nil, filepath.Join(d.bin, "pg_restore"), drillConn(d.new, "-d", "postgres", "--create", "--exit-on-error", d.path("buzzpg.dump"))...)
	// A dump carries no planner statistics; until autovacuum gathers them, REQs may scan whole tables.
	drillRun(t, nil, filepath.Join(d.bin, "vacuumdb"), drillConn(d.new, "-d", drillDB, "--analyze-only", "-q")...)
	owner := d.new.URL("")
	drillRun(t, []string{"DATABASE_URL=" + owner}, testenv.Binary(t), "migrate", "up")
	d.newPool = testenv.Pool(t, owner)
	if n := testenv.MustInt(t, d.newPool, `SELECT count(*) FROM pg_replication_slots`); n != 0 {
		t.Fatalf("%d replication slots after the restore, want none (a dump carries no slot)", n)
	}
	d.checkBackup()
}

// checkBackup records what the backup holds: which reminder versions are confirmed and which are
// not, and which viewers are owed a snapshot.
func (d *drill) checkBackup() {
	t := d.t
	d.backup = drillReminderStates(t, d.newPool, d.author.PK)
	want := map[string]string{"conf1": "confirmed", "conf2": "confirmed", "held": "claimed", "sqlclaim": "claimed",
		"due": "armed", "future": "armed", "post": ""}
	for name, state := range want {
		if got := d.backup[d.rem[name].ID]; got != state {
			t.Errorf("in the backup reminder %s is %q, want %q", name, got, state)
		}
	}
	in := 0
	for _, ev := range d.duringDump {
		if st, ok := d.backup[ev.ID]; ok {
			in++
			if st != "armed" {
				t.Errorf("a reminder stored during the dump is %s in the backup, want armed", st)
			}
		}
	}
	var confirmed, not []string
	for id, state := range d.backup {
		if state == "confirmed" {
			confirmed = append(confirmed, d.name(id))
		} else {
			not = append(not, d.name(id)+" ("+state+")")
		}
	}
	slices.Sort(confirmed)
	slices.Sort(not)
	t.Logf("backup: reminders confirmed: %s; not confirmed: %s (%d of the %d stored during the dump are in it)",
		strings.Join(confirmed, ", "), strings.Join(not, ", "), in, len(d.duringDump))
	for _, v := range append(slices.Clone(d.claimed), d.pending...) {
		if target, published := snapGens(t, d.newPool, v); target <= published {
			t.Errorf("viewer %.8s is not owed a snapshot in the backup (generation %d, published %d)", v, target, published)
		}
	}
	if n := testenv.MustInt(t, d.newPool, `SELECT count(*) FROM buzz.visibility_outbox WHERE claim_id IS NOT NULL`); n != len(d.claimed) {
		t.Errorf("%d outbox rows claimed in the backup, want %d", n, len(d.claimed))
	}
	l := drillReadLag(t, d.newPool)
	t.Logf("backup: %d viewers owed a snapshot, %d of them claimed by the dead process", l.pending, l.claimed+l.expired)
}

// serveRestored starts the new server as the old one was configured (key, instance id, login).
// Its scheduler claims what is due at once; reminder.after_claim holds it there until the author
// has subscribed, so no due signal goes out to nobody.
func (d *drill) serveRestored() {
	t := d.t
	hookDir := t.TempDir()
	d.newRelay = testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: testenv.AsRole(t, d.new.URL(""), drillRole), RelayKey: d.key,
		InstanceID: drillInstance, Env: drillEnv(nil), HookDir: hookDir, Hooks: []string{"reminder.after_claim"}})
	hooks.Wait(t, hookDir, "reminder.after_claim", 30*time.Second)
	d.dueNew = remDueSub(t, d.newRelay.URL, d.author.SK, d.author.PK)
	hooks.Release(t, hookDir, "reminder.after_claim")
}

// checkReminders: every version the backup holds unconfirmed arrives exactly once; none that it
// holds confirmed, and none it does not hold, arrives at all.
func (d *drill) checkReminders() {
	t := d.t
	var want []string
	for id, state := range d.backup {
		if state != "confirmed" && state != "cancelled" {
			want = append(want, id)
		}
	}
	d.waitDelivered(want, 60*time.Second)
	barrier := remDueBarrier(t, d.newPool, d.author.SK, d.dueNew)
	counts := d.dueNew.Counts()
	delete(counts, barrier)
	for _, id := range want {
		if counts[id] != 1 {
			t.Errorf("reminder %s (%s in the backup) delivered %d times after the restore, want 1", d.name(id), d.backup[id], counts[id])
		}
		delete(counts, id)
	}
	for id, n := range counts {
		t.Errorf("reminder %s (%q in the backup) delivered %d times after the restore, want 0", d.name(id), d.backup[id], n)
	}
	for _, name := range []string{"held", "sqlclaim"} {
		if r := remGet(t, d.newPool, d.rem[name].ID); r.State != "confirmed" || r.Recoveries != 1 {
			t.Errorf("reminder %s after the restore: %+v, want confirmed after one recovery", name, r)
		}
	}
	t.Logf("delivered after the restore: %s", d.deliveredNames(d.dueNew, nil))
}

// waitDelivered waits until each of ids arrived on the new server; at the deadline it names the
// missing ones with their state in the backup and now.
func (d *drill) waitDelivered(ids []string, timeout time.Duration) {
	t := d.t
	deadline := time.Now().Add(timeout)
	for {
		counts := d.dueNew.Counts()
		var missing []string
		for _, id := range ids {
			if counts[id] == 0 {
				missing = append(missing, id)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for i, id := range missing {
				missing[i] = fmt.Sprintf("%s (%s in the backup, %s now)", d.name(id), d.backup[id], remGet(t, d.newPool, id).State)
			}
			t.Fatalf("after %s, not delivered since the restore: %s", timeout, strings.Join(missing, ", "))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// name is the drill's name of reminder id.
func (d *drill) name(id string) string {
	for name, ev := range d.rem {
		if ev.ID == id {
			return name
		}
	}
	for i, ev := range d.duringDump {
		if ev.ID == id {
			return fmt.Sprint("during", i)
		}
	}
	return id
}

// checkViewers: every viewer's head is its hidden set, and the tracked ones' the model's.
func (d *drill) checkViewers() {
	t := d.t
	viewers := testenv.MustColumn[string](t, d.newPool, `SELECT viewer FROM buzz.visibility_state ORDER BY viewer`)
	drillConverged(t, d.newPool, viewers, 60*time.Second)
	d.checkModel(d.newPool)
}

// checkSlot: the new server made its slot on the new cluster.
func (d *drill) checkSlot() {
	t := d.t
	slots := testenv.MustColumn[string](t, d.newPool, `SELECT format('%s on %s (%s)', slot_name, database, plugin)
		FROM pg_replication_slots`)
	if want := fmt.Sprintf("buzz_%s on %s (pgoutput)", drillInstance, drillDB); !slices.Equal(slots, []string{want}) {
		t.Errorf("replication slots after the restore: %v, want [%s]", slots, want)
	}
}

// republishAll is the restore's last step: a client that got a snapshot from the old server after
// the backup holds a newer created_at than the restored head and would keep it; a new snapshot for
// every viewer supersedes it.
func (d *drill) republishAll() {
	t := d.t
	testenv.MustInt(t, d.newPool, `SELECT count(buzz.bump_visibility(viewer))
		FROM (SELECT viewer FROM buzz.visibility_state ORDER BY viewer OFFSET 0) v`)
	heads := drillConverged(t, d.newPool, d.viewers(), 60*time.Second)
	for v, lost := range d.lost {
		if heads[v] <= lost {
			t.Errorf("viewer %.8s: republished at %d, not after the lost snapshot of %d", v, heads[v], lost)
		}
	}
	d.checkModel(d.newPool)
}
