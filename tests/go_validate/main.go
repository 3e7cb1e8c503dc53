// Validates values against the checked-in JSON Schemas with a Go validator in its default
// options, as a Go consumer would (github.com/santhosh-tekuri/jsonschema):
//
//	go run . SCHEMA_DIR VALUE.json...
//
// Every *.schema.json compiles; each value is checked against event.schema.json, its own
// type's schema and, for the types the outcomes topic carries, outcome.schema.json. One
// line per failure, then a count; exit status 1 on any failure.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: go run . SCHEMA_DIR VALUE.json...")
		os.Exit(2)
	}
	schemaDir, values := os.Args[1], os.Args[2:]
	names, err := filepath.Glob(filepath.Join(schemaDir, "*.schema.json"))
	if err != nil || len(names) == 0 {
		fmt.Fprintln(os.Stderr, "no *.schema.json in", schemaDir)
		os.Exit(2)
	}
	sort.Strings(names)
	compiler := jsonschema.NewCompiler() // default options: the dialect each schema declares
	compiled := map[string]*jsonschema.Schema{}
	for _, name := range names {
		schema, err := compiler.Compile(name)
		if err != nil {
			fmt.Printf("%s does not compile: %v\n", filepath.Base(name), err)
			os.Exit(1)
		}
		compiled[filepath.Base(name)] = schema
	}
	outcomeTypes := map[string]bool{}
	for _, ref := range compiled["outcome.schema.json"].OneOf {
		outcomeTypes[ref.Ref.Location[strings.LastIndex(ref.Ref.Location, "/")+1:]] = true
	}
	failures := 0
	check := func(against string, value any, file string) {
		schema, known := compiled[against]
		if !known {
			failures++
			fmt.Printf("%s: no schema %s\n", file, against)
			return
		}
		if err := schema.Validate(value); err != nil {
			failures++
			fmt.Printf("%s against %s: %s\n", file, against, strings.ReplaceAll(err.Error(), "\n", " "))
		}
	}
	for _, file := range values {
		f, err := os.Open(file)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		value, err := jsonschema.UnmarshalJSON(f)
		f.Close()
		if err != nil {
			fmt.Printf("%s is not JSON: %v\n", file, err)
			failures++
			continue
		}
		kind, _ := value.(map[string]any)["type"].(string)
		check("event.schema.json", value, file)
		check(kind+".schema.json", value, file)
		if outcomeTypes[kind] {
			check("outcome.schema.json", value, file)
		}
	}
	// A value of no known type must be refused, or the checks above prove nothing.
	bogus := map[string]any{"type": "NoSuchEvent", "schema_version": 1, "event_id": "e", "conversation_id": "c",
		"occurred_at": 1}
	if compiled["event.schema.json"].Validate(bogus) == nil {
		failures++
		fmt.Println("an unknown type was accepted")
	}
	fmt.Printf("%d schemas compiled, %d values checked, %d failures\n", len(compiled), len(values), failures)
	if failures > 0 {
		os.Exit(1)
	}
}
