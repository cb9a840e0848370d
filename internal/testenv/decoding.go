package testenv

import (
	"encoding/json"
	"fmt"
	"strings"
)

// DueSignal is one reminder due signal as emitted in a 'buzz' logical message.
type DueSignal struct {
	Stamp int64
	Scope string
	Event map[string]any // the stored 30300 as JSON (id, pubkey, created_at, kind, tags, content, sig)
}

// ID is the signalled event's id.
func (s DueSignal) ID() string { id, _ := s.Event["id"].(string); return id }

// DueSignals reads one row of a test_decoding slot. A 'buzz' message row ("message:
// transactional: 1 prefix: buzz, sz: N content:{...}") yields its due signals: one for a "due"
// message, one per item of a batch confirm's "dues". Any other row yields none; a 'buzz' message
// that is not JSON is an error. Tests that count emissions read through this, so a change of the
// message format cannot hide signals from them.
func DueSignals(row string) ([]DueSignal, error) {
	i := strings.Index(row, "content:")
	if !strings.HasPrefix(row, "message:") || !strings.Contains(row, "prefix: buzz,") || i < 0 {
		return nil, nil
	}
	type item struct {
		Stamp int64          `json:"stamp"`
		Ev    map[string]any `json:"ev"`
	}
	var m struct {
		T     string `json:"t"`
		Scope string `json:"scope"`
		Items []item `json:"items"`
		item
	}
	if err := json.Unmarshal([]byte(row[i+len("content:"):]), &m); err != nil {
		return nil, fmt.Errorf("undecodable buzz message %q: %w", row, err)
	}
	switch m.T {
	case "due":
		m.Items = []item{m.item}
	case "dues":
	default:
		return nil, nil
	}
	out := make([]DueSignal, 0, len(m.Items))
	for _, it := range m.Items {
		out = append(out, DueSignal{Stamp: it.Stamp, Scope: m.Scope, Event: it.Ev})
	}
	return out, nil
}
