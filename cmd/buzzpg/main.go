// Command buzzpg is the one binary of buzzpg: the relay and listener (`serve`), migrations,
// key generation, operator sends and the load tool.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
)

const usage = `buzzpg: a Nostr relay for team chat whose side effects live in PostgreSQL

usage:
  buzzpg serve [flags]              run the relay and the listener (--no-relay: listener only)
  buzzpg migrate up | down N | down all | version | force VERSION
  buzzpg keygen [--out FILE]        print (or write) a new relay secret key
  buzzpg send --channel ID --as PUBKEY TEXT
                                    post a kind 9 signed by the relay key on PUBKEY's behalf
  buzzpg bench SCENARIO [flags]     load tool (see buzzpg bench --help)

Configuration comes from the environment (DATABASE_URL, BUZZ_*), each with a serve flag.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = runServe(os.Args[2:])
	case "migrate":
		err = runMigrate(os.Args[2:])
	case "keygen":
		err = runKeygen(os.Args[2:])
	case "send":
		err = runSend(os.Args[2:])
	case "bench":
		err = runBench(os.Args[2:])
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "buzzpg: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if errors.Is(err, flag.ErrHelp) {
		return // -h: the flag set printed the usage
	}
	if err != nil {
		if !errors.As(err, new(loggedError)) {
			fmt.Fprintf(os.Stderr, "buzzpg %s: %v\n", os.Args[1], err)
		}
		os.Exit(1)
	}
}
