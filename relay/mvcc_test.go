package relay

import (
	"strconv"
	"testing"
)

func TestMVCCSnapshotSees(t *testing.T) {
	snap, err := parseMVCCSnapshot("100:110:107,103")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		xid  uint32
		want bool
	}{
		{99, true},   // ended before the oldest one running
		{100, true},  // xmin itself is not running unless listed (a committed, delivered one)
		{103, false}, // running at the snapshot
		{105, true},  // ended between xmin and xmax
		{107, false},
		{110, false}, // started after the snapshot
		{4000, false},
	} {
		if got := snap.sees(c.xid); got != c.want {
			t.Errorf("sees(%d) = %v, want %v", c.xid, got, c.want)
		}
	}

	// Across the 32-bit wrap: epoch 1, the delivered xid only has its low bits.
	const epoch = uint64(1) << 32
	wrapped, err := parseMVCCSnapshot("4294967290:" + strconv.FormatUint(epoch+5, 10) + ":" + strconv.FormatUint(epoch+2, 10))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		xid  uint32
		want bool
	}{
		{4294967289, true}, // epoch 0, before xmin
		{4294967295, true}, // epoch 0, ended
		{1, true},          // epoch 1, ended
		{2, false},         // epoch 1, running
		{5, false},         // epoch 1, after the snapshot
	} {
		if got := wrapped.sees(c.xid); got != c.want {
			t.Errorf("across the wrap: sees(%d) = %v, want %v", c.xid, got, c.want)
		}
	}
	for _, bad := range []string{"", "1:2", "a:2:", "1:2:x"} {
		if _, err := parseMVCCSnapshot(bad); err == nil {
			t.Errorf("parseMVCCSnapshot(%q): no error", bad)
		}
	}
}
