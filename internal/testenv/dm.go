package testenv

import (
	"encoding/json"
	"strings"
	"testing"
)

// DMChannelID is the channel id in the OK message of an accepted DM open (41010), whose shape is
// response:{"channel_id":...,"created":...}; a message without one fails the test.
func DMChannelID(t testing.TB, msg string) string {
	t.Helper()
	var resp struct {
		ChannelID string `json:"channel_id"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &resp); err != nil || resp.ChannelID == "" {
		t.Fatalf("DM open answered %q: %v", msg, err)
	}
	return resp.ChannelID
}
