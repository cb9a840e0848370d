package testenv

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// LogBuf captures log records for assertions; it is safe for concurrent use.
type LogBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LogBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *LogBuf) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

// Logger sends records at level and above to t.Log and, when buf is not nil, to buf.
func Logger(t testing.TB, level slog.Level, buf *LogBuf) *slog.Logger {
	return slog.New(slog.NewTextHandler(&tLog{t: t, buf: buf}, &slog.HandlerOptions{Level: level}))
}

type tLog struct {
	t   testing.TB
	buf *LogBuf
}

func (w *tLog) Write(p []byte) (int, error) {
	if w.buf != nil {
		w.buf.Write(p)
	}
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
