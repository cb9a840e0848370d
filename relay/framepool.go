package relay

import (
	"math/bits"
	"sync"
	"unsafe"
)

// Frames of initial answers are most of what the relay allocates while serving REQs: about 50 kB
// per REQ of 100 rows, each row's EVENT frame living only until the writer has put it on the
// socket. At 1,000 REQs a second that ran the collector 11 times a second, each cycle taking a
// quarter of the process's cores for 5 to 16 ms and stalling the goroutines that allocate
// (docs/benchmarks.md). So these frames come from size-classed pools and go back once written
// (sendQueue.pushHalfFrame, sendQueue.recycle): nothing else ever holds them.

const (
	frameMinShift = 9  // 512 B: most rows of a chat relay fit
	frameMaxShift = 16 // 64 KiB: larger frames are allocated as before
	frameClasses  = frameMaxShift - frameMinShift + 1
)

// framePools[i] holds buffers of exactly 1<<(frameMinShift+i) bytes, as pointers to their first
// byte: a pointer in an interface costs no allocation, a slice would.
var framePools [frameClasses]sync.Pool

// frameClass is the pool whose buffers hold n bytes, or -1 for none.
func frameClass(n int) int {
	if n <= 1<<frameMinShift {
		return 0
	}
	if n > 1<<frameMaxShift {
		return -1
	}
	return bits.Len(uint(n-1)) - frameMinShift
}

// getFrame returns an empty buffer with room for n bytes. It comes from a pool unless n is larger
// than the largest class; putFrame gives it back.
func getFrame(n int) []byte {
	c := frameClass(n)
	if c < 0 {
		return make([]byte, 0, n)
	}
	size := 1 << (frameMinShift + c)
	if p, ok := framePools[c].Get().(*byte); ok {
		return unsafe.Slice(p, size)[:0]
	}
	return make([]byte, 0, size)
}

// putFrame gives back a buffer from getFrame that nothing refers to any more. A buffer that grew
// past its class (append reallocated it) or was never pooled is left to the collector.
func putFrame(b []byte) {
	c := frameClass(cap(b))
	if c < 0 || cap(b) != 1<<(frameMinShift+c) {
		return
	}
	framePools[c].Put(unsafe.SliceData(b))
}
