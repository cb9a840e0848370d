package relay

import (
	"encoding/binary"
	"runtime"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func fifoKey(i int) idKey {
	var k idKey
	binary.BigEndian.PutUint64(k[8:], uint64(i)+1)
	return k
}

// After EOSE a subscription keeps only the newest seenAfterEOSE ids, oldest first, and goes on as
// a FIFO of that size; a ring that never filled keeps what it has.
func TestSeenShrinkKeepsTheNewest(t *testing.T) {
	for _, added := range []int{seenPerSub + 1000, seenPerSub, 100} {
		f := newIDFIFO[idKey](seenPerSub)
		for i := 0; i < added; i++ {
			f.add(fifoKey(i))
		}
		f.shrink(seenAfterEOSE)
		for i := 0; i < added; i++ {
			if want := i >= added-seenAfterEOSE; f.has(fifoKey(i)) != want {
				t.Fatalf("%d added, shrunk: has(%d) = %v, want %v", added, i, !want, want)
			}
		}
		if f.add(fifoKey(added - 1)) {
			t.Fatalf("%d added, shrunk: the newest id was added again", added)
		}
		// One more than the window pushes out exactly the oldest kept id.
		oldest := max(0, added-seenAfterEOSE)
		for i := 0; i < seenAfterEOSE; i++ {
			f.add(fifoKey(added + i))
		}
		if kept := min(added, seenAfterEOSE); kept == seenAfterEOSE && f.has(fifoKey(oldest)) {
			t.Fatalf("%d added, shrunk, %d more: the oldest kept id %d is still there", added, seenAfterEOSE, oldest)
		}
		if !f.has(fifoKey(added+seenAfterEOSE-1)) || len(f.set) != seenAfterEOSE || len(f.ring) != seenAfterEOSE {
			t.Fatalf("%d added, shrunk, %d more: %d in the set, %d in the ring; want %d", added, seenAfterEOSE, len(f.set), len(f.ring), seenAfterEOSE)
		}
	}
}

// The point of shrinking: a full window of seenPerSub ids costs a subscription about 224 KiB for
// as long as it lives; the shrunk one a fraction of that (measured on the heap).
func TestSeenShrinkGivesMemoryBack(t *testing.T) {
	const n = 100
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	base := heap()
	fifos := make([]*idFIFO[idKey], n)
	for j := range fifos {
		fifos[j] = newIDFIFO[idKey](seenPerSub)
		for i := 0; i < seenPerSub; i++ {
			fifos[j].add(fifoKey(j*seenPerSub + i))
		}
	}
	full := heap() - base
	for _, f := range fifos {
		f.shrink(seenAfterEOSE)
	}
	shrunk := heap() - base
	t.Logf("per subscription: %d KiB full, %d KiB shrunk", full/n/1024, shrunk/n/1024)
	if shrunk*3 > full {
		t.Fatalf("shrunk windows hold %d bytes, full ones %d: want at most a third", shrunk, full)
	}
	runtime.KeepAlive(fifos)
}

// A subscription's window is shrunk by the time its EOSE is sent, and it still drops a live event
// delivered twice.
func TestSeenWindowShrinksAtEOSE(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	c.req("s", nostr.Filter{Authors: []string{pk}})
	var window int
	for _, sc := range tr.s.snapshotConns() {
		sc.mu.Lock()
		if sub := sc.subs["s"]; sub != nil {
			sub.mu.Lock()
			window = sub.seen.cap
			sub.mu.Unlock()
		}
		sc.mu.Unlock()
	}
	if window != seenAfterEOSE {
		t.Fatalf("window after EOSE: %d ids, want %d", window, seenAfterEOSE)
	}
	ev := signed(sk, 1, "twice", nostr.Now())
	tr.s.DeliverEvent(publicDelivery(&ev))
	if got := c.nextEvent("s"); got.ID != ev.ID {
		t.Fatalf("live event %s, want %s", got.ID, ev.ID)
	}
	tr.s.DeliverEvent(publicDelivery(&ev))
	syncNone(t, c, "s")
}
