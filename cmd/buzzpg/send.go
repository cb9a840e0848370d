package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/store"
)

// RelaySignedMessage builds a kind 9 in channel on actor's behalf, signed by the relay key. It
// resurfaces the DM like any human-visible message, with actor as the sender.
func RelaySignedMessage(relaySK, channel, actor, text string, at time.Time) (*nostr.Event, error) {
	ev := &nostr.Event{
		Kind:      9,
		CreatedAt: nostr.Timestamp(at.Unix()),
		Tags:      nostr.Tags{{"h", channel}, {"actor", actor}},
		Content:   text,
	}
	if err := ev.Sign(relaySK); err != nil {
		return nil, err
	}
	return ev, nil
}

func runSend(args []string) error {
	fs := flag.NewFlagSet("send", flag.ExitOnError)
	channel := fs.String("channel", "", "DM channel id (uuid)")
	as := fs.String("as", "", "hex pubkey of the member this message is sent for (the actor)")
	key := fs.String("relay-key", envStr("BUZZ_RELAY_KEY", ""), "relay secret key (BUZZ_RELAY_KEY)")
	keyFile := fs.String("relay-key-file", envStr("BUZZ_RELAY_KEY_FILE", ""), "relay key file (BUZZ_RELAY_KEY_FILE)")
	_ = fs.Parse(args)
	text := strings.Join(fs.Args(), " ")
	if *channel == "" || *as == "" || text == "" {
		return errors.New("usage: buzzpg send --channel ID --as PUBKEY TEXT")
	}
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		return errors.New("DATABASE_URL is not set")
	}
	sk, _, err := loadRelayKey(*key, *keyFile)
	if err != nil {
		return err
	}
	ev, err := RelaySignedMessage(sk, *channel, *as, text, time.Now())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := db.NewPool(ctx, url, "buzzpg-send", 1)
	if err != nil {
		return err
	}
	defer pool.Close()
	ok, msg, err := store.Accept(ctx, pool, ev)
	if err != nil {
		return err
	}
	fmt.Printf("%s %v %q\n", ev.ID, ok, msg)
	if !ok {
		return fmt.Errorf("rejected: %s", msg)
	}
	return nil
}
