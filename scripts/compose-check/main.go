// compose-check loads a Compose file the way `docker compose config` does, with the Compose
// Specification's own Go loader (schema validation, interpolation, normalization), and prints
// the resolved project as JSON. For machines with a Docker client but no Compose plugin.
//
//	go run ./scripts/compose-check [--profile NAME]... FILE
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
)

type profiles []string

func (p *profiles) String() string     { return strings.Join(*p, ",") }
func (p *profiles) Set(v string) error { *p = append(*p, v); return nil }

func main() {
	var active profiles
	flag.Var(&active, "profile", "activate a profile (repeatable)")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: compose-check [--profile NAME]... FILE")
		os.Exit(2)
	}
	options, err := cli.NewProjectOptions(
		[]string{flag.Arg(0)},
		cli.WithOsEnv,
		cli.WithDotEnv,
		cli.WithProfiles(active),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-check:", err)
		os.Exit(1)
	}
	project, err := options.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-check:", err)
		os.Exit(1)
	}
	out, err := project.MarshalJSON()
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-check:", err)
		os.Exit(1)
	}
	fmt.Println(string(out))
}
