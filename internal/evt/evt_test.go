package evt

import "testing"

// The live gate fails closed: a scope it does not know, the zero one included, is nobody's.
func TestReadable(t *testing.T) {
	member := func(channel, pubkey string) bool { return channel == "dm" && pubkey == "bob" }
	for _, c := range []struct {
		name   string
		scope  Scope
		authed []string
		want   bool
	}{
		{"public, anonymous", Scope{Kind: ScopePublic}, nil, true},
		{"zero scope", Scope{}, []string{"alice", "bob"}, false},
		{"unknown kind", Scope{Kind: 'x'}, []string{"alice"}, false},
		{"author", Scope{Kind: ScopeAuthor}, []string{"carol", "alice"}, true},
		{"not the author", Scope{Kind: ScopeAuthor}, []string{"bob"}, false},
		{"p, recipient", Scope{Kind: ScopeP, P: "bob"}, []string{"bob"}, true},
		{"p, the author is not the recipient", Scope{Kind: ScopeP, P: "bob"}, []string{"alice"}, false},
		{"channel member", Scope{Kind: ScopeChannel, Channel: "dm"}, []string{"carol", "bob"}, true},
		{"channel, not a member", Scope{Kind: ScopeChannel, Channel: "dm"}, []string{"alice"}, false},
		{"channel, anonymous", Scope{Kind: ScopeChannel, Channel: "dm"}, nil, false},
	} {
		if got := c.scope.Readable("alice", c.authed, member); got != c.want {
			t.Errorf("%s: Readable = %v, want %v", c.name, got, c.want)
		}
	}
}
