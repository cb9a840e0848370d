package relay

import (
	"bytes"
	"testing"
	"unsafe"
)

func sameArray(a, b []byte) bool {
	return cap(a) > 0 && cap(b) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}

// getFrame hands out buffers of its classes (powers of two from 512 B to 64 KiB) with room for
// what was asked; larger ones are plain allocations, and putFrame keeps only class-sized buffers.
func TestFramePoolClasses(t *testing.T) {
	for _, n := range []int{0, 1, 512, 513, 1000, 4096, 4097, 65536} {
		f := getFrame(n)
		if len(f) != 0 || cap(f) < n || cap(f)&(cap(f)-1) != 0 || cap(f) < 512 || cap(f) > 65536 {
			t.Fatalf("getFrame(%d): len %d cap %d, want an empty power-of-two class in [512, 64 KiB] with room", n, len(f), cap(f))
		}
	}
	if f := getFrame(65537); cap(f) != 65537 {
		t.Fatalf("getFrame(65537): cap %d, want a plain allocation of 65537", cap(f))
	}
	odd := make([]byte, 0, 700) // not a class size: never pooled
	putFrame(odd)
	for range 8 {
		if sameArray(getFrame(700), odd) {
			t.Fatal("a buffer of no class size came out of a pool")
		}
	}
}

// Only frames the queue owns (pushHalfFrame with owned) go back to a pool, and only when the
// writer gives the written batch back (recycle), also when a batch is a part of the queue. A
// message someone else may hold (a live event's frame, a reply) or a frame not yet written would
// be overwritten by the next answer's rows.
func TestSendQueueRecyclesOnlyOwnedWrittenFrames(t *testing.T) {
	q := newSendQueue(1 << 20)
	var shared, owned [][]byte
	for i := range 6 {
		s := append(make([]byte, 0, 512), bytes.Repeat([]byte{'s'}, 200)...) // a class size, not owned
		o := append(getFrame(200), bytes.Repeat([]byte{byte('a' + i)}, 200)...)
		if !q.push(s) {
			t.Fatal("push refused")
		}
		if ok, _, _ := q.pushHalfFrame(o, true); !ok {
			t.Fatal("pushHalfFrame refused")
		}
		shared, owned = append(shared, s), append(owned, o)
	}
	isQueued := func(f []byte) bool {
		for _, m := range append(append([][]byte{}, shared...), owned...) {
			if sameArray(f, m) {
				return true
			}
		}
		return false
	}
	var taken [][][]byte
	var takenOwned [][]bool
	for {
		b, o := q.takeFrames(500) // two or three messages a batch: flags must stay with them
		if len(b) == 0 {
			break
		}
		taken, takenOwned = append(taken, b), append(takenOwned, o)
		for range 4 {
			if f := getFrame(200); isQueued(f) {
				t.Fatal("a frame came out of a pool before the writer gave it back")
			}
		}
	}
	for i := range taken {
		q.recycle(taken[i], takenOwned[i])
	}
	back := 0
	for range 32 {
		f := getFrame(200)
		for _, s := range shared {
			if sameArray(f, s) {
				t.Fatal("a message the queue did not own went to a pool")
			}
		}
		for _, o := range owned {
			if sameArray(f, o) {
				back++
			}
		}
	}
	if back == 0 {
		t.Log("no owned frame came back (the pool may drop them at a collection)")
	}
}

// The arrays of a written batch serve the next pushes (recycle); messages queued meanwhile keep
// their order and bytes.
func TestSendQueueReusesBatchArraysInOrder(t *testing.T) {
	q := newSendQueue(1 << 20)
	next, want := 0, 0
	push := func(k int) {
		for range k {
			if !q.push([]byte{byte(next)}) {
				t.Fatal("push refused")
			}
			next++
		}
	}
	push(5)
	for round := range 20 {
		b, o := q.takeFrames(1 << 20)
		push(round % 4) // queued while the batch is being written
		for _, m := range b {
			if m[0] != byte(want) {
				t.Fatalf("round %d: message %d out, want %d", round, m[0], want)
			}
			want++
		}
		q.written(len(b))
		q.recycle(b, o)
		push(3)
	}
}
