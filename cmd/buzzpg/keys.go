package main

import (
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/nbd-wtf/go-nostr"
)

func runKeygen(args []string) error {
	fs := flag.NewFlagSet("keygen", flag.ExitOnError)
	out := fs.String("out", "", "write the secret key to this file (mode 0600) instead of stdout; an existing file is kept")
	_ = fs.Parse(args)
	if *out != "" {
		if _, err := os.Stat(*out); err == nil {
			return nil
		}
	}
	sk := nostr.GeneratePrivateKey()
	if *out == "" {
		fmt.Println(sk)
		return nil
	}
	return os.WriteFile(*out, []byte(sk+"\n"), 0o600)
}

// loadRelayKey returns the relay secret key from BUZZ_RELAY_KEY or BUZZ_RELAY_KEY_FILE, checked.
func loadRelayKey(key, file string) (sk, pk string, err error) {
	if key == "" && file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return "", "", fmt.Errorf("relay key: cannot read BUZZ_RELAY_KEY_FILE %s: %w (create one with `buzzpg keygen --out %s`)", file, err, file)
		}
		key = strings.TrimSpace(string(b))
	}
	if key == "" {
		return "", "", errors.New("relay key: none configured; set BUZZ_RELAY_KEY (hex) or BUZZ_RELAY_KEY_FILE (create one with `buzzpg keygen --out .data/relay.key`)")
	}
	if b, err := hex.DecodeString(key); err != nil || len(b) != 32 {
		return "", "", errors.New("relay key: must be 64 hex characters (a 32-byte secp256k1 secret key); generate one with `buzzpg keygen`")
	}
	pk, err = nostr.GetPublicKey(key)
	if err != nil {
		return "", "", fmt.Errorf("relay key: not a valid secp256k1 secret key: %w", err)
	}
	// Zero and the group order decode to a "public key" too but cannot sign: every snapshot and
	// operator send would fail later, one by one. A probe signature finds out now.
	probe := nostr.Event{Kind: 1}
	if err := probe.Sign(key); err != nil {
		return "", "", fmt.Errorf("relay key: cannot sign with it (%v); generate one with `buzzpg keygen`", err)
	}
	return key, pk, nil
}
