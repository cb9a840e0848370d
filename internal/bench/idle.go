package bench

import (
	"fmt"
	"time"

	"github.com/buzzpg/buzzpg/internal/wsclient"
	"github.com/nbd-wtf/go-nostr"
)

// idlePerIP keeps the idle connections under a relay's default per-IP cap (BUZZ_IP_MAX_CONNS,
// 1,000), beside the scenario's own connections from 127.0.0.1.
const idlePerIP = 500

// dialIdle opens n connections spread over relays, like a team's clients that are connected but
// quiet: each authenticates as a user of its own and subscribes to its snapshots (kind 30622 #p)
// and to a feed of 50 other authors (kinds 1, 6, 7), none of whom posts in the scenario. They
// receive nothing, so they measure what live delivery spends on connections that want none of
// the traffic. They connect from 127.0.1.x, idlePerIP to an address.
func dialIdle(relays []string, n int, logf func(string, ...any)) ([]*wsclient.Client, error) {
	if n <= 0 {
		return nil, nil
	}
	logf("idle: %d connections (authenticated, snapshots + a 50-author feed each)", n)
	// Connection setup only, not part of any measurement: 32 at a time.
	return dialEach(n, 32, func(i int) (*wsclient.Client, error) {
		c, err := idleConn(relays[i%len(relays)], fmt.Sprintf("127.0.1.%d", 1+i/idlePerIP))
		if err != nil {
			err = fmt.Errorf("idle connection %d: %w", i, err)
		}
		return c, err
	})
}

func idleConn(relay, localIP string) (*wsclient.Client, error) {
	c, err := wsclient.DialFrom(relay, localIP, wsclient.Handlers{}, 10*time.Second)
	if err != nil {
		return nil, err
	}
	u := NewUser()
	follows := make([]string, 50)
	for j := range follows {
		follows[j] = NewUser().PK
	}
	err = c.Auth(u.SK, 10*time.Second, nil)
	if err == nil {
		err = c.Req("snap", 10*time.Second, nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": []string{u.PK}}, Limit: 1})
	}
	if err == nil {
		err = c.Req("feed", 10*time.Second, nostr.Filter{Kinds: []int{1, 6, 7}, Authors: follows, Limit: 20})
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}
