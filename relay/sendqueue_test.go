package relay

import (
	"bytes"
	"testing"
)

// The writer takes the queue in bounded batches (so the write deadline asks for progress, not
// for the whole queue at once), in order, never an empty batch while something is queued, and a
// message larger than the bound alone.
func TestSendQueueTakesBoundedBatchesInOrder(t *testing.T) {
	q := newSendQueue(1 << 20)
	var want [][]byte
	for i, n := range []int{100, 200, 300, 50, 1000, 10, 10, 10} {
		m := bytes.Repeat([]byte{byte('a' + i)}, n)
		if !q.push(m) {
			t.Fatalf("push %d refused", i)
		}
		want = append(want, m)
	}
	var got [][]byte
	var sizes []int
	for {
		batch := q.take(400)
		if len(batch) == 0 {
			break
		}
		size := 0
		for _, m := range batch {
			size += len(m)
		}
		if size > 400 && len(batch) > 1 {
			t.Fatalf("a batch of %d bytes in %d messages over a 400-byte bound", size, len(batch))
		}
		sizes = append(sizes, size)
		got = append(got, batch...)
		q.written(size)
	}
	if len(got) != len(want) {
		t.Fatalf("%d messages out, %d in", len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("message %d out of order", i)
		}
	}
	// 100+200 | 300+50 | 1000 alone | 10+10+10
	if w := []int{300, 350, 1000, 30}; len(sizes) != len(w) || sizes[0] != w[0] || sizes[1] != w[1] || sizes[2] != w[2] || sizes[3] != w[3] {
		t.Fatalf("batches of %v bytes, want %v", sizes, w)
	}
	if q.size != 0 {
		t.Fatalf("%d bytes still counted after everything was written", q.size)
	}
}
